"""What a peer's checkpoint holds besides weights, read into one typed result: optimizer state and progress.

A user moving here hands over what Composer, Lightning, Hugging Face, Ray Train or MindSpore wrote. The weights
load as before (``weights.unwrap``: the layouts and prefixes), and where the file also carries the optimizer and
the position reached, ``read_peer_checkpoint`` returns them in this product's terms so that a run started with
``load_weights_only=false`` can continue rather than restart:

- ``optimizer_state`` is a torch optimizer ``state_dict`` keyed by parameter *index* (what ``Optimizer.
  load_state_dict`` takes). Composer writes it keyed by parameter *name* (torch's distributed-checkpoint form) and
  MindSpore keeps one slot per named parameter; their names are kept in ``optimizer_param_names`` so that
  ``optimizer_state_for`` can put the entries in the order of the recipe's own optimizer;
- ``progress`` uses ``training.position.progress.Progress``'s names (``epoch`` = completed epochs, ``step`` = optimizer
  steps, ``samples_seen``, ``sample_in_epoch``, ``global_batch_size``), only those the peer records;
- ``taken`` says what was found and can be carried over, ``left`` what the file holds that is not, and why.

Nothing here runs code from the file: pickles go through ``safe_types`` (a short allow-list), MindSpore's
protobuf through ``mindspore_ckpt``, safetensors hold none. No Prefect here (``checkpointing`` never imports it).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch

from checkpointing.errors import WeightsError
from checkpointing.io import confine
from checkpointing.io.protocols import is_local_fs, open_url
from checkpointing.manifest import MANIFEST
from checkpointing.peers import mindspore as mindspore_ckpt
from checkpointing.peers import mindspore_output
from checkpointing.peers.folders import Folder, peer_folder_kind, read_folder
from checkpointing.peers.weights import (
    WEIGHTS_SUFFIXES,
    WRAPPER_PREFIXES,
    Weights,
    decode_weights_file,
    default_max_bytes,
    is_safetensors,
    read_bounded,
    safetensors_metadata,
)


@dataclass
class PeerCheckpoint:
    weights: Weights
    optimizer_state: dict[str, Any] | None = None  # torch optimizer state_dict, parameters by index
    optimizer_param_names: list[str] | None = None  # the name of each index, where the peer recorded names
    scheduler_state: dict[str, Any] | None = None  # torch LR scheduler state_dict, where there is exactly one
    progress: dict[str, int] | None = None  # Progress's names: epoch, step, samples_seen, sample_in_epoch, ...
    description: str = ""  # e.g. "a Composer checkpoint (composer 0.32.1)"
    taken: list[str] = field(default_factory=list)  # what can be carried over, one phrase each
    left: list[str] = field(default_factory=list)  # what the file holds that is not carried over, and why
    extras: dict[str, Any] = field(default_factory=dict)  # the peer's small values (hyper-parameters, run name)


def read_peer_checkpoint(
    uri: str,
    storage_options: dict[str, Any] | None = None,
    *,
    option: str = "load_path",
    max_bytes: int | None = None,
) -> PeerCheckpoint:
    """Reads a weights file or a peer's weights folder into a PeerCheckpoint. Raises WeightsError (or
    UnsafeCheckpointError for a pickle that needs code) with one line naming ``option`` and ``uri``."""
    where = f"{option}={uri!r}"
    limit = default_max_bytes() if max_bytes is None else max_bytes
    fs, path = open_url(str(uri), storage_options)
    is_folder = (is_local_fs(fs) and _local_dir(path)) or (not is_local_fs(fs) and fs.isdir(path))
    kind = peer_folder_kind(fs, path) if is_folder else None
    if kind is not None and kind.startswith("mindspore-"):
        chosen = mindspore_output.choose(str(uri), storage_options, kind.removeprefix("mindspore-"), where)
        chosen, peer = mindspore_output.read(  # a damaged newest file: the next newest (MindSpore's fallback)
            chosen, where, lambda at, what: decode_peer_file(read_bounded(at, storage_options, what, limit), what)
        )
        peer.description = f"{chosen.how}: {peer.description}"
        return peer
    if kind is not None:
        folder = read_folder(str(uri), storage_options, where, limit)
        if folder.kind == "files":
            name, data = folder.files[0]
            peer = decode_peer_file(data, f"{where} ({name})")
            peer.description = f"{folder.what}: {peer.description}"
            return peer
        return _merge(folder, where)
    if str(uri).endswith(COMPOSER_SYMLINK):
        target, where = _follow_composer_symlink(str(uri), storage_options, where), f"{where} (the file it names)"
        peer = decode_peer_file(read_bounded(target, storage_options, where, limit), where)
        peer.description += ", through Composer's .symlink"
        return peer
    return decode_peer_file(read_bounded(str(uri), storage_options, where, limit), where)


def decode_peer_file(data: bytes, where: str) -> PeerCheckpoint:
    """One file's bytes -> PeerCheckpoint: MindSpore (``.ckpt`` or ``format=ms`` safetensors), safetensors, or a
    torch.save file of any known layout."""
    if mindspore_ckpt.looks_like_ckpt(data):
        try:
            return _mindspore(mindspore_ckpt.read_ckpt(data), "a MindSpore checkpoint (.ckpt)", where)
        except mindspore_ckpt.MindSporeFormatError as exc:
            raise WeightsError(f"{where}: {exc}") from exc
    if is_safetensors(data) and safetensors_metadata(data).get("format") == "ms":
        return _mindspore(_safetensors(data, where), "a MindSpore checkpoint (safetensors)", where)
    weights, obj = decode_weights_file(data, where)
    if not isinstance(obj, Mapping):
        return PeerCheckpoint(weights, description=weights.description, taken=["weights"])
    state = obj.get("state")
    if isinstance(state, Mapping) and "model" in state and ("timestamp" in state or "optimizers" in state):
        return _composer(weights, obj, state)
    if "state_dict" in obj and ("pytorch-lightning_version" in obj or "optimizer_states" in obj):
        return _lightning(weights, obj)
    return _user_dict(weights, obj)


def optimizer_state_for(peer: PeerCheckpoint, param_names: list[str]) -> dict[str, Any] | None:
    """``peer.optimizer_state`` with its indexes in the order of ``param_names`` (the recipe optimizer's parameters,
    by model key). Where the peer recorded no names, its own order is kept (the order its optimizer was given the
    parameters, ``model.parameters()`` for Lightning). A wrapper prefix (``module.``) is stripped as for weights."""
    state, names = peer.optimizer_state, peer.optimizer_param_names
    if state is None or names is None:
        return state
    names = _strip_prefix(names, set(param_names))
    position = {name: i for i, name in enumerate(names)}
    absent = [n for n in param_names if n not in position]
    if absent:
        raise WeightsError(f"the optimizer state has no entry for {len(absent)} parameter(s) ({absent[:3]})")
    new_id = {position[n]: i for i, n in enumerate(param_names)}
    # Optimizer.load_state_dict pairs a group's saved ids with its own parameters in order: ids ascending
    groups = [{**g, "params": sorted(new_id[p] for p in g["params"] if p in new_id)} for g in state["param_groups"]]
    return {"state": {new_id[k]: v for k, v in state["state"].items() if k in new_id}, "param_groups": groups}


COMPOSER_SYMLINK = ".symlink"  # Composer's latest pointer in object stores

# torch.optim.SGD's group keys besides lr and momentum, as nn.Momentum behaves by default (use_nesterov=False)
_SGD_DEFAULTS = {
    "dampening": 0,
    "nesterov": False,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}


# -- peers -----------------------------------------------------------------------------------------
def _composer(weights: Weights, obj: Mapping[str, Any], state: Mapping[str, Any]) -> PeerCheckpoint:
    metadata: Mapping[str, Any] = _get(state, "metadata") if isinstance(_get(state, "metadata"), Mapping) else {}
    version = _get(metadata, "composer_env_info", "composer_version")
    peer = PeerCheckpoint(weights, description=f"a Composer checkpoint{f' (composer {version})' if version else ''}")
    peer.taken.append(f"weights ({len(weights.state_dict)} tensors, ['state']['model'])")
    _take_optimizer(peer, _single(state.get("optimizers")), "['state']['optimizers']")
    _take_scheduler(peer, _single(state.get("schedulers")), "['state']['schedulers']")
    timestamp = _single(state.get("timestamp"))
    if isinstance(timestamp, Mapping):
        progress = {
            "epoch": timestamp.get("epoch"),
            "step": timestamp.get("batch"),
            "samples_seen": timestamp.get("sample"),
            "sample_in_epoch": timestamp.get("sample_in_epoch"),
            "batch_in_epoch": timestamp.get("batch_in_epoch"),
        }
        per_rank, world = metadata.get("train_dataloader_batch_size"), metadata.get("world_size")
        if isinstance(per_rank, int) and isinstance(world, int):
            progress["global_batch_size"] = per_rank * world
        _take_progress(peer, progress, "['state']['timestamp']")
    peer.extras = {k: state[k] for k in ("run_name", "rank_zero_seed") if k in state}
    _leave(peer, obj.get("rng"), "rng (Composer's per-rank Python/NumPy/torch RNG states; this product seeds its own)")
    for key, why in (
        ("callbacks", "Composer callbacks' state"),
        ("algorithms", "Composer algorithms' state"),
        ("scaler", "the AMP grad scaler; this product makes its own for precision=fp16"),
        ("train_metrics", "torchmetrics state"),
        ("eval_metrics", "torchmetrics state"),
        ("dataset_state", "Composer's dataset state"),
    ):
        _leave(peer, state.get(key), f"{key} ({why})")
    return peer


def _lightning(weights: Weights, obj: Mapping[str, Any]) -> PeerCheckpoint:
    version = obj.get("pytorch-lightning_version")
    peer = PeerCheckpoint(weights, description=f"a Lightning checkpoint{f' (lightning {version})' if version else ''}")
    peer.taken.append(f"weights ({len(weights.state_dict)} tensors, ['state_dict'])")
    optimizers, schedulers = obj.get("optimizer_states"), obj.get("lr_schedulers")
    if isinstance(optimizers, list) and len(optimizers) > 1:
        peer.left.append(f"optimizer_states ({len(optimizers)} optimizers; a recipe has one)")
    else:
        _take_optimizer(
            peer, optimizers[0] if isinstance(optimizers, list) and optimizers else None, "optimizer_states[0]"
        )
    if isinstance(schedulers, list) and len(schedulers) == 1:
        _take_scheduler(peer, schedulers[0], "lr_schedulers[0]")
    peer.progress = _lightning_progress(obj)
    if peer.progress:
        peer.taken.append(f"progress ({_counts(peer.progress)}, from epoch/global_step/loops)")
    hparams = obj.get("hyper_parameters")
    peer.extras = {"hyper_parameters": dict(hparams)} if isinstance(hparams, Mapping) else {}
    _leave(peer, obj.get("callbacks"), "callbacks (ModelCheckpoint's paths and scores: they name the old run's files)")
    _leave(peer, obj.get("hyper_parameters"), "hyper_parameters (in extras, to compare with recipe_args)")
    return peer


def _lightning_progress(obj: Mapping[str, Any]) -> dict[str, int] | None:
    """Lightning saves at an epoch's end before it counts that epoch completed (``epoch_progress.current``:
    processed 2, completed 1 in ``last.ckpt`` after 2 epochs); ``batch_progress.is_last_batch`` tells a finished
    epoch from one in progress, whose batches done are ``batch_progress.current.completed``."""
    step = obj.get("global_step")
    if not (isinstance(step, int) and _is_count(step)):
        return None
    epochs = _get(obj, "loops", "fit_loop", "epoch_progress", "current")
    batches = _get(obj, "loops", "fit_loop", "epoch_loop.batch_progress")
    processed, completed = _get(epochs, "processed"), _get(epochs, "completed")
    if not (
        isinstance(processed, int) and isinstance(completed, int) and _is_count(processed) and _is_count(completed)
    ):
        return {"step": step}  # no loop state (an older or hand-made file): the epoch count is not certain
    if _get(batches, "is_last_batch") is True:
        return {"epoch": max(processed, completed), "step": step}
    done = _get(batches, "current", "completed")
    return {"epoch": completed, "step": step, **({"batch_in_epoch": done} if isinstance(done, int) else {})}


def _user_dict(weights: Weights, obj: Mapping[str, Any]) -> PeerCheckpoint:
    """A dict the user ``torch.save``d (Ray Train's checkpoints): an optimizer state under a usual key is taken;
    counters are reported but not carried, their meaning is the user's (Ray's guide saves the last epoch's index)."""
    peer = PeerCheckpoint(weights, description=weights.description)
    peer.taken.append(f"weights ({len(weights.state_dict)} tensors)")
    for key in ("optimizer", "optimizer_state_dict", "optim", "optimizer_state"):
        if _is_optimizer_state(obj.get(key)):
            _take_optimizer(peer, obj[key], repr([key]))
            break
    counters = {k: obj[k] for k in ("epoch", "step", "global_step", "iteration") if _is_count(obj.get(k))}
    if counters:
        peer.left.append(f"progress {counters} (the user's own keys; their meaning is not known here)")
    peer.extras = {k: v for k, v in obj.items() if not isinstance(v, (Mapping, list, torch.Tensor))}
    return peer


def _mindspore(tensors: dict[str, Any], what: str, where: str) -> PeerCheckpoint:
    weights, slots, other = mindspore_ckpt.split(tensors)
    if not weights:
        raise WeightsError(f"{where}: {what} with no network weights")
    peer = PeerCheckpoint(Weights(weights, what), description=what)
    peer.taken.append(f"weights ({len(weights)} tensors)")
    lr, momentum = other.get("learning_rate"), other.get("momentum")
    if (
        slots
        and {"momentum_buffer"} == {k for s in slots.values() for k in s}
        and isinstance(lr, float)
        and isinstance(momentum, float)
    ):
        # nn.Momentum: accum = momentum * accum + grad; param -= lr * accum: torch SGD's momentum buffer
        names = [n for n in weights if n in slots]
        group: dict[str, Any] = {**_SGD_DEFAULTS, "params": list(range(len(names)))}
        group.update({"lr": lr, "momentum": momentum})
        group.update({"weight_decay": other.get("weight_decay", 0.0), "initial_lr": group["lr"]})
        peer.optimizer_state = {"state": {i: dict(slots[n]) for i, n in enumerate(names)}, "param_groups": [group]}
        peer.optimizer_param_names = names
        peer.taken.append("optimizer state (nn.Momentum's moments as SGD momentum buffers, by parameter name)")
    elif slots:
        peer.left.append(
            f"optimizer slots {sorted({k for s in slots.values() for k in s})} (MindSpore's own optimizer)"
        )
    step, batch = other.get("global_step", other.get("step_num")), other.get("global_batch_size")
    progress: dict[str, Any] = {"epoch": other.get("epoch_num"), "step": step}
    where_from = "epoch_num/global_step"
    if isinstance(step, int) and isinstance(batch, int) and _is_count(step) and _is_count(batch) and batch > 0:
        # MindSpore Transformers' CheckpointMonitor records the global batch size (MindSpore's own does not)
        progress.update(samples_seen=step * batch, global_batch_size=batch)
        where_from += "/global_batch_size"
    _take_progress(peer, progress, where_from)
    peer.extras = {k: v for k, v in other.items() if not isinstance(v, torch.Tensor)}
    return peer


# -- helpers ---------------------------------------------------------------------------------------
def _take_optimizer(peer: PeerCheckpoint, state: Any, where: str) -> None:
    if not _is_optimizer_state(state):
        return
    params = [p for g in state["param_groups"] for p in g["params"]]
    if params and all(isinstance(p, str) for p in params):  # by name (torch.distributed.checkpoint's form)
        ids = {name: i for i, name in enumerate(params)}
        state = {
            "state": {ids[k]: v for k, v in state["state"].items() if k in ids},
            "param_groups": [{**g, "params": [ids[p] for p in g["params"]]} for g in state["param_groups"]],
        }
        peer.optimizer_param_names = params
    elif not all(_is_count(p) for p in params):
        peer.left.append(f"optimizer state at {where} (parameters neither by index nor by name)")
        return
    peer.optimizer_state = dict(state)
    peer.taken.append(f"optimizer state ({len(params)} parameters, {where})")


def _take_scheduler(peer: PeerCheckpoint, state: Any, where: str) -> None:
    if isinstance(state, Mapping) and "last_epoch" in state:
        peer.scheduler_state = dict(state)
        peer.taken.append(f"scheduler state ({where}, last_epoch={state['last_epoch']})")


def _take_progress(peer: PeerCheckpoint, progress: dict[str, Any], where: str) -> None:
    counts = {k: v for k, v in progress.items() if _is_count(v)}
    if counts:
        peer.progress = counts
        peer.taken.append(f"progress ({_counts(counts)}, from {where})")


def _is_optimizer_state(state: Any) -> bool:
    return (
        isinstance(state, Mapping)
        and isinstance(state.get("state"), Mapping)
        and isinstance(state.get("param_groups"), list)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in state["param_groups"])
    )


def _single(value: Any) -> Any:
    """Composer keys its optimizers, schedulers and timestamp by class name: the one value, if there is one."""
    return next(iter(value.values())) if isinstance(value, Mapping) and len(value) == 1 else None


def _leave(peer: PeerCheckpoint, value: Any, what: str) -> None:
    if value:
        peer.left.append(what)


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _counts(progress: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in progress.items())


def _strip_prefix(names: list[str], model_names: set[str]) -> list[str]:
    for prefix in WRAPPER_PREFIXES:
        if names and all(n.startswith(prefix) for n in names) and not any(m.startswith(prefix) for m in model_names):
            return _strip_prefix([n[len(prefix) :] for n in names], model_names)
    return names


def _safetensors(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(data)
    except safetensors.SafetensorError as exc:
        raise WeightsError(f"{where}: not a valid safetensors file ({exc})") from exc


def _merge(folder: Folder, where: str) -> PeerCheckpoint:
    """A Hugging Face folder's file or shards into one state_dict: a key in two shards, or a key the index names
    but its shard lacks, is an error."""
    merged: dict[str, torch.Tensor] = {}
    for name, data in folder.files:
        part = decode_peer_file(data, f"{where} ({name})").weights.state_dict
        twice = merged.keys() & part.keys()
        if twice:
            raise WeightsError(f"{where}: {len(twice)} key(s) in more than one shard (first {sorted(twice)[0]!r})")
        merged.update(part)
    absent = sorted(folder.indexed_keys - merged.keys())
    if absent:
        raise WeightsError(f"{where}: {len(absent)} key(s) of the index are in no shard (first {absent[0]!r})")
    return PeerCheckpoint(
        Weights(merged, folder.what), description=folder.what, taken=[f"weights ({len(merged)} tensors)"]
    )


def _follow_composer_symlink(uri: str, options: dict[str, Any] | None, where: str) -> str:
    """Composer's ``latest-rank0.pt.symlink``: a text object holding the object name of the newest checkpoint
    (object stores have no links). Followed only to a file in the same folder."""
    data = read_bounded(uri, options, where, 4096)
    try:
        target = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise WeightsError(f"{where}: not a Composer .symlink file (not text)") from exc
    folder, name = posixpath.split(target)
    here = posixpath.dirname(open_url(uri, options)[1])
    folder = folder.strip("/")
    same_folder = not folder or here.strip("/") == folder or here.endswith(f"/{folder}")
    if not name or name in (".", "..") or "\\" in name or not same_folder:
        raise WeightsError(f"{where}: the Composer .symlink points outside its own folder; name the checkpoint file")
    return f"{uri.rsplit('/', 1)[0]}/{name}"


def _local_dir(path: str) -> bool:
    if confine.local_roots() is not None:  # a deployment run's load_path: a link on the way is refused
        return confine.kind(path, f"load_path={path!r}") == "dir"
    return os.path.isdir(path)


def is_weights_file(uri: str, storage_options: dict[str, Any] | None = None) -> bool:
    """True when ``uri`` names a file (or a missing path that looks like one) or a peer's weights folder (Hugging
    Face ``save_pretrained``, a Ray Train checkpoint: ``checkpointing.peers.folders``), not one of our checkpoint or
    run folders.

    Anything local that exists and is not a directory counts, FIFOs and devices included, so that
    ``read_weights`` refuses them by name instead of the folder reader calling them "no checkpoint"."""
    uri = str(uri).rstrip("/")
    if uri.endswith(f"/{MANIFEST}"):
        return False
    fs, path = open_url(uri, storage_options)
    if is_local_fs(fs):
        confined = confine.local_roots() is not None  # a deployment run's load_path: never looked at through a link
        if confine.kind(path, f"load_path={uri!r}") is not None if confined else os.path.lexists(path):
            return not _local_dir(path) or peer_folder_kind(fs, path) is not None
    elif fs.isfile(path):
        return True
    elif fs.isdir(path):
        return peer_folder_kind(fs, path) is not None
    return uri.lower().endswith(WEIGHTS_SUFFIXES) and not fs.exists(path)


def read_weights(
    uri: str,
    storage_options: dict[str, Any] | None = None,
    *,
    option: str = "load_path",
    max_bytes: int | None = None,
) -> Weights:
    """Reads a weights file, or a peer's weights folder (Hugging Face, Ray), and returns its state_dict. Raises
    WeightsError (or UnsafeCheckpointError for a pickle that needs code) with one line naming ``option`` and
    ``uri``. The peers' optimizer state and progress: ``read_peer_checkpoint``."""
    return read_peer_checkpoint(uri, storage_options, option=option, max_bytes=max_bytes).weights
