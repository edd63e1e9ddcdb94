"""Warm start from ``load_path``: checked against the recipe before anything is written, then loaded.

``load_path`` names a checkpoint or run folder of ours (its full state, or its weights with ``load_weights_only``)
or a weights file or folder from anywhere (``checkpointing.peers.weights``): a state_dict, an export, safetensors, or a
peer's checkpoint (``checkpointing.peers.formats``). Weights are matched to the recipe's model by key and shape
under ``load_strict`` and ``load_ignore_keys``. With ``load_weights_only=false`` a new run takes what else a
Composer, Lightning, MindSpore or Ray file holds: the optimizer state (re-keyed to the recipe's optimizer) and the
progress counters, under this run's hyper-parameters (training/start/carry_over.py). The flow calls ``check_load_path``
first, on a model and optimizer built on the meta device (shapes, no memory), so a mismatch fails the run before it
claims or writes anything; the unit then calls ``load_start`` and reads the file once more (both through
training/start/load_path.py, the one reader of ``load_path``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointing import CheckpointStore, NotACheckpointError, UnsafeCheckpointError
from checkpointing.io import confine
from checkpointing.peers.formats import PeerCheckpoint, optimizer_state_for
from checkpointing.peers.weights import LoadReport, WeightsError, check_match, load_into, match, tied_keys
from checkpointing.store import STATE_FILE
from training.config import ConfigError, TrainConfig
from training.position.progress import Progress, check_progress, is_complete, rescaled
from training.recipe.loader import load_recipe, open_dataset, uses_own_loop
from training.start.carry_over import check_model_fits, check_optimizer_fits, optimizer_param_names, peer_progress
from training.start.load_path import read_checkpoint, read_weights

logger = logging.getLogger(__name__)
WEIGHTS_ONLY = "load_weights_only=true to take the weights alone"
# A full-state carry-over onto other data (MindSpore Transformers' "resume with the dataset changed" scenarios)
CHANGED_DATA = (
    "to carry the optimizer state and progress over onto this data, set ignore_data_skip=true (its epoch starts at "
    f"its first sample) or data_skip_steps=<n> (n of its batches skipped); or set {WEIGHTS_ONLY} and count from zero"
)


@dataclass
class Start:
    """What load_path gave a new run besides the weights (already in the model): parts to load, by TrainState's
    names (``optimizer``), and the peer's progress counters. Both empty: weights only."""

    origin: str  # for people: "weights of <uri> (load_path: ...)"
    state: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, int] | None = None

    @property
    def weights_only(self) -> bool:
        return not self.state and not self.progress


def load_weights(config: TrainConfig, model: torch.nn.Module) -> str | None:
    """Loads ``load_path``'s weights alone into ``model`` (parallelism='fsdp' takes nothing else) and says where they
    came from; None when a folder's full state is wanted."""
    start = load_start(config, model, None)
    return None if start is None else start.origin


def load_start(config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Start | None:
    """Loads ``load_path``'s weights into ``model`` when they come from a file or a peer's folder (or a folder of ours
    with load_weights_only), and returns what else carries over into ``optimizer`` (None: weights only); None when a
    folder of ours gives its full state (the session loads it whole)."""
    found = read_weights(config)
    if found is None:
        return None
    peer, origin = found.peer, found.origin
    nothing_else = peer.optimizer_state is None and not peer.progress
    if nothing_else and not config.load_weights_only:
        logger.info("load_path is a weights file: weights only; optimizer, scheduler and progress start fresh")
    report = _load(config, model, peer)
    if config.load_weights_only or nothing_else:
        return Start(origin)
    reason = "parallelism='fsdp' takes weights only from load_path" if optimizer is None else _partial(report)
    if reason or optimizer is None:
        logger.info("load_path: weights only (%s); optimizer, scheduler and progress start fresh", reason)
        return Start(origin)
    state = {}
    if peer.optimizer_state is not None:
        names = optimizer_param_names(model, optimizer)
        state["optimizer"] = _optimizer_state(config, peer, optimizer, names)
    logger.info("load_path: %s", carried_text(peer))
    return Start(f"state of {config.load_path} (load_path: {peer.description})", state, peer.progress)


def carried_text(peer: PeerCheckpoint) -> str:
    """What is taken from a peer's file and what is left there (``PeerCheckpoint.taken/left``), in one line: the
    scheduler's position is taken as the carried step of the recipe's own schedule (its shape is the recipe's)."""
    taken, left = [], list(peer.left)
    for item in peer.taken:
        if not item.startswith("scheduler state"):
            taken.append(item)
        elif peer.progress:
            taken.append(f"{item}, as the position of the recipe's own schedule, continued at the carried step")
        else:
            left.append(f"{item} (no progress to place it at: the recipe's schedule starts fresh)")
    if peer.optimizer_state is None:
        left.append("no optimizer state in the file: the optimizer starts fresh")
    return f"from {peer.description} took {'; '.join(taken)}. Left: {'; '.join(left) or 'nothing'}"


def _partial(report: LoadReport) -> str:
    """Why a partial load takes weights only ("" for a load of the whole model)."""
    if not report.ignored and report.ok:
        return ""
    return (
        f"{report.model_keys - len(report.loaded)} model keys keep their initialization (load_ignore_keys / "
        f"load_strict=false): the file's optimizer state and progress belong to the model it was trained as"
    )


def _optimizer_state(
    config: TrainConfig, peer: PeerCheckpoint, optimizer: torch.optim.Optimizer, names: list[str]
) -> dict[str, Any]:
    """The peer's optimizer state re-keyed to the recipe optimizer's parameters, checked to fit it."""
    try:
        state = optimizer_state_for(peer, names)
    except WeightsError as exc:
        raise ConfigError(f"{_where(config)}: {exc}; set {WEIGHTS_ONLY}") from exc
    assert state is not None
    check_optimizer_fits(optimizer, state, names, _where(config), f"set {WEIGHTS_ONLY}")
    return state


def _load(config: TrainConfig, model: torch.nn.Module, peer: PeerCheckpoint) -> LoadReport:
    try:
        report = load_into(
            model,
            peer.weights.state_dict,
            strict=config.load_strict,
            ignore_keys=config.load_ignore_keys,
            where=_where(config),
        )
    except WeightsError as exc:
        raise ConfigError(str(exc)) from exc
    if report.stripped_prefix:
        logger.info("load_path: stripped the prefix %r that wraps every key of the file", report.stripped_prefix)
    logger.info("load_path: %s (%s)", report.summary(), peer.weights.description)
    return report


def check_before_start(config: TrainConfig) -> None:
    """``check_load_path`` for ``python -m flows.train`` before Prefect starts, so that a bad load_path is one
    line, not a failed flow run's traceback and then the line. Only when the run has no checkpoint yet: a
    run that resumes ignores load_path (its file may be long gone); nor for a loop of its own, which builds its own
    model and takes load_path's state from ``ctx.get_checkpoint()`` (as ``Run.open`` skips it)."""
    if (
        config.load_path
        and not uses_own_loop(config)
        and CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options).latest()
        is None
    ):
        check_load_path(config)


def check_load_path(config: TrainConfig) -> None:
    """Everything about ``load_path`` that can fail, checked before the run writes anything: the URI names a
    checkpoint or a readable, safe weights file; its weights fit the recipe's model (tied keys count as one); and
    with load_weights_only=false, the optimizer state it carries fits the recipe's optimizer and the progress it
    carries leaves something to train. A config that passed once in this process is not read again (the unit still
    checks what it loads)."""
    key = _check_key(config)
    if key in _passed:
        return
    try:
        found = read_weights(config)
        if found is None:
            if config.load_ignore_keys or not config.load_strict:
                raise ConfigError(
                    f"load_path={config.load_path!r} is a checkpoint folder and load_weights_only=false: its full "
                    f"state must match; load_strict and load_ignore_keys apply to weights: set load_weights_only=true"
                )
            if config.parallelism == "fsdp":
                raise ConfigError(
                    f"load_path={config.load_path!r}: with parallelism='fsdp' a new run takes weights only; set "
                    f"load_weights_only=True"
                )
            _check_full_folder(config)
        else:
            _check_peer(config, found.peer)
    except (WeightsError, NotACheckpointError, UnsafeCheckpointError) as exc:
        raise ConfigError(str(exc)) from exc
    _passed.add(key)


_passed: set[str] = set()


def _check_peer(config: TrainConfig, peer: PeerCheckpoint) -> None:
    model, optimizer = _recipe_objects(config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    _, report = match(shapes, peer.weights.state_dict, ignore_keys=config.load_ignore_keys, aliases=tied_keys(model))
    check_match(report, _where(config), config.load_strict)
    if config.load_weights_only or config.parallelism == "fsdp" or _partial(report):
        return
    if peer.optimizer_state is not None:
        _optimizer_state(config, peer, optimizer, optimizer_param_names(model, optimizer))
    if peer.progress:
        needs_size = "samples_seen" not in peer.progress  # samples_seen and the step at this run's batch size
        progress, _ = peer_progress(peer.progress, _epoch_size(config) if needs_size else 0)
        _check_progress(config, progress, _where(config))


def _check_full_folder(config: TrainConfig) -> None:
    """Our checkpoint or run folder, whose full state a new run takes: its model and optimizer must fit whole."""
    loaded = read_checkpoint(config)
    state = loaded.objects[STATE_FILE]["state"]
    model, optimizer = _recipe_objects(config)
    fix = "check recipe and recipe_args, or take the weights that fit: load_weights_only=true load_strict=false"
    what = f"load_path={config.load_path!r} ({loaded.info.name})"
    check_model_fits(model, state["model"], what, fix)
    if state.get("optimizer") is not None:
        names = optimizer_param_names(model, optimizer)
        check_optimizer_fits(optimizer, state["optimizer"], names, what, f"set {WEIGHTS_ONLY}")
    skipped = bool(loaded.info.manifest.metadata.get("data_skip_applied"))
    _check_progress(config, Progress.from_dict(loaded.info.progress), what, skipped=skipped)


def _check_progress(config: TrainConfig, progress: Progress, what: str, *, skipped: bool = False) -> None:
    """The progress a new run carries places it in the recipe's data (training/position/progress.py), and counts max_duration
    from it (Composer's rule): refused when nothing would be left to train."""
    if config.ignore_data_skip or config.data_skip_steps is not None:
        # the new data's position is the option's (reposition applies it before the first batch), not the file's
        progress, skipped = dataclasses.replace(progress, sample_in_epoch=0), True
    epoch_size = _epoch_size(config) if progress.sample_in_epoch else 0
    changed_data = bool(epoch_size) and progress.sample_in_epoch >= epoch_size  # an epoch shorter than the file's
    fix = CHANGED_DATA if changed_data else f"set {WEIGHTS_ONLY} and count from zero"
    check_progress(progress, epoch_size, what, fix, skipped=skipped)
    p = rescaled(progress, config.global_batch_size)
    if is_complete(p, config.duration):
        raise ConfigError(
            f"load_path={config.load_path!r} stands at epoch {p.epoch}, step {p.step} ({p.samples_seen} samples), "
            f"which load_weights_only=false carries over and which already reaches max_duration="
            f"{config.max_duration!r}: set max_duration past it (it counts the whole run, as Composer's does), or "
            f"{WEIGHTS_ONLY} and count from zero"
        )


def _check_key(config: TrainConfig) -> str:
    fields = ("load_path", "load_weights_only", "load_strict", "load_ignore_keys", "recipe", "recipe_args",
              "max_duration", "global_batch_size", "parallelism")  # fmt: skip
    confined = confine.local_roots()  # a check passed unconfined (links followed) does not pass a confined run
    return json.dumps([getattr(config, f) for f in fields] + [confined], sort_keys=True, default=str)


def _recipe_objects(config: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The recipe's model and optimizer, built on the meta device (no memory, no init work)."""
    recipe = load_recipe(config)
    try:
        with torch.device("meta"):
            model = recipe.build_model()
            return model, recipe.build_optimizer(model)
    except Exception:  # a build that cannot run on the meta device (it reads a file, say): build it for real
        model = recipe.build_model()
        return model, recipe.build_optimizer(model)


def _epoch_size(config: TrainConfig) -> int:
    return len(open_dataset(load_recipe(config)))


def _where(config: TrainConfig) -> str:
    return f"load_path={config.load_path!r}"
