"""Weights files that are not checkpoint folders: read without running code, matched to a model by name.

``load_path`` may name one file on any fsspec store holding a plain ``state_dict``, this product's export
(``{"model": ..., "metadata": ...}``), a Composer checkpoint (``{"state": {"model": ...}}``), a Lightning
checkpoint (``{"state_dict": ...}``), a ``.safetensors`` file or a MindSpore ``.ckpt``; or a Hugging Face or Ray
Train folder (``peer_folders``). What else a peer's file carries (optimizer, progress): ``peer_formats``. It
comes from a flow-run parameter, so it is untrusted: pickles are read with ``torch.load(weights_only=True)`` and
a short allow-list of harmless types (``safe_types``; safetensors and protobuf hold no code at all), a local path
must be a regular file (a FIFO would block the worker, ``/dev/zero`` never ends), and the size is checked against
what the worker can hold before a byte is read. Errors name the file and the problem, never its content.

Two verbs: ``read_weights(uri) -> Weights`` and ``load_into(model, state_dict, ...) -> LoadReport``;
``match`` is the pure key/shape comparison both the loader and the flow's up-front check use.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import safetensors
import safetensors.torch
import torch

from checkpointing.errors import UnsafeCheckpointError, WeightsError
from checkpointing.io import confine
from checkpointing.io.protocols import is_local_fs, open_url
from checkpointing.peers.safe_types import load_with_peer_types

WEIGHTS_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
# Prefixes that wrappers add to every key: DDP ("module."), torch.compile ("_orig_mod."), and the
# attribute a LightningModule or a wrapper most often keeps its network in ("model.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
_COMPOSER_PATH = "state/model/"
_USER_KEYS = ("model_state_dict", "model_weights")
_EXAMPLES = 3


@dataclass
class Weights:
    state_dict: dict[str, torch.Tensor]
    description: str  # what the file was, e.g. "a Composer checkpoint (['state']['model'])"
    metadata: dict[str, Any] = field(default_factory=dict)  # an export's recipe, recipe_args, version


@dataclass
class LoadReport:
    """What ``match`` found: keys loaded, left out by load_ignore_keys, and the mismatches."""

    loaded: list[str]
    ignored: list[str]
    missing: list[str]  # in the model, not in the file: they keep the model's fresh initialization
    unexpected: list[str]  # in the file, not in the model
    mismatched: list[str]  # in both, with another shape
    stripped_prefix: str = ""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    model_keys: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        skipped = len(self.ignored) + len(self.unexpected) + len(self.mismatched)
        return (
            f"loaded {len(self.loaded)} of the model's {self.model_keys} keys; skipped {skipped} keys of the file "
            f"({len(self.ignored)} by load_ignore_keys, {len(self.unexpected)} not in the model, "
            f"{len(self.mismatched)} of another shape); {self.model_keys - len(self.loaded)} model keys keep their "
            f"initialization ({len(self.missing)} of them missing from the file)"
        )


def decode_weights_file(data: bytes, where: str) -> tuple[Weights, Any]:
    """A weights file's bytes -> (its Weights, the object torch.load gave, or None for safetensors)."""
    if is_safetensors(data):
        try:
            tensors = safetensors.torch.load(data)
        except safetensors.SafetensorError as exc:
            raise WeightsError(f"{where}: not a valid safetensors file ({exc})") from exc
        return Weights(tensors, "a safetensors file", safetensors_metadata(data)), None
    if not data.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip format, or its legacy pickle
        raise WeightsError(
            f"{where}: neither a torch.save file, a safetensors file nor a MindSpore checkpoint (its first bytes "
            f"match none of their layouts)"
        )
    obj = _torch_load(data, where)
    return unwrap(obj, where), obj


def match(
    model_shapes: Mapping[str, Any],
    state_dict: Mapping[str, Any],
    *,
    ignore_keys: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], LoadReport]:
    """Compares a state_dict with a model's ``{key: shape}``; returns what can be loaded and the report.

    A prefix that wraps every key of the file and none of the model's (``module.``, ``_orig_mod.``,
    ``model.``) is stripped first. Keys matching a load_ignore_keys glob are left out on both sides:
    dropped from the file, and not counted missing from the model (they keep their initialization). Model keys
    that share one parameter (``aliases``, from ``tied_keys``) are not missing when the file gives one of them."""
    state_dict, stripped = _strip_wrapper_prefixes(dict(state_dict), set(model_shapes))
    patterns = [p.removeprefix(_COMPOSER_PATH) for p in ignore_keys]

    def ignored(key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(stripped + key, p) for p in patterns)

    ignored_keys = sorted(k for k in state_dict if ignored(k))
    wanted = {k: tuple(s) for k, s in model_shapes.items() if not ignored(k)}
    given = {k: v for k, v in state_dict.items() if not ignored(k)}
    shapes = {k: (tuple(given[k].shape), wanted[k]) for k in given.keys() & wanted.keys()}
    mismatched = sorted(k for k, (a, b) in shapes.items() if a != b)
    loadable = {k: v for k, v in given.items() if k in wanted and k not in mismatched}
    given_ties = {(aliases or {}).get(k) for k in loadable} - {None}  # the tied groups the file fills
    report = LoadReport(
        loaded=sorted(loadable),
        ignored=ignored_keys,
        missing=sorted(k for k in wanted.keys() - given.keys() if (aliases or {}).get(k) not in given_ties),
        unexpected=sorted(given.keys() - wanted.keys()),
        mismatched=mismatched,
        stripped_prefix=stripped,
        shapes={k: shapes[k] for k in mismatched},
        model_keys=len(model_shapes),
    )
    return loadable, report


def check_match(report: LoadReport, where: str, strict: bool) -> None:
    """Raises one WeightsError line for a strict load that does not match, or for one that loads nothing."""
    if strict and not report.ok:
        raise WeightsError(f"{where}: the weights do not match the model: {mismatch_text(report)}")
    if not report.loaded:
        raise WeightsError(
            f"{where}: no key of the file matches the model ({mismatch_text(report)}); is it the weights of "
            f"another model?"
        )


def mismatch_text(report: LoadReport, ways_out: bool = True) -> str:
    """The first few missing, unexpected and reshaped keys, and (``ways_out``) load_path's two ways out: a full
    checkpoint's state must fit whole, so its callers name their own."""
    parts = []
    for label, keys in (("missing from the file", report.missing), ("not in the model", report.unexpected)):
        if keys:
            parts.append(f"{len(keys)} {label} ({_examples(keys)})")
    if report.mismatched:
        shown = ", ".join(
            f"{k!r} file {list(report.shapes[k][0])} vs model {list(report.shapes[k][1])}"
            for k in report.mismatched[:_EXAMPLES]
        )
        parts.append(f"{len(report.mismatched)} of another shape ({shown})")
    if not ways_out:
        return "; ".join(parts)
    first = (report.mismatched or report.missing or report.unexpected or ["<key>"])[0]
    glob = f"{first.rsplit('.', 1)[0]}.*" if "." in first else first
    return (
        f"{'; '.join(parts)}; set load_strict=false to load the keys that match, or "
        f"load_ignore_keys=[{glob!r}] to leave keys out"
    )


def load_into(
    model: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    ignore_keys: Iterable[str] = (),
    where: str = "load_path",
) -> LoadReport:
    """Loads the matching part of ``state_dict`` into ``model``; with ``strict`` any mismatch is an error."""
    model_state = model.state_dict()
    loadable, report = match(
        {k: v.shape for k, v in model_state.items()}, state_dict, ignore_keys=ignore_keys, aliases=tied_keys(model)
    )
    check_match(report, where, strict)
    model.load_state_dict(loadable, strict=False)
    return report


def tied_keys(model: torch.nn.Module) -> dict[str, str]:
    """``{key: the first key of its group}`` for parameters shared under several keys (a language model's output
    layer and its embedding): Hugging Face writes one key of the group, and loading it fills them all."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: group[0] for group in names.values() if len(group) > 1 for name in group}


def default_max_bytes() -> int:
    """Half the machine's memory: a file larger than that cannot be held as bytes and tensors at once."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 64 << 30


# -- reading ---------------------------------------------------------------------------------------
def read_bounded(uri: str, storage_options: dict[str, Any] | None, where: str, max_bytes: int) -> bytes:
    fs, path = open_url(uri, storage_options)
    if is_local_fs(fs):
        return _read_local(path, where, max_bytes)
    try:
        info = fs.info(path)
    except FileNotFoundError as exc:
        raise WeightsError(f"{where}: no such file") from exc
    if info.get("type") != "file":
        raise WeightsError(f"{where}: not a file (a {info.get('type')}); name a weights file or a checkpoint folder")
    size = int(info.get("size") or 0)
    _check_size(size, where, max_bytes)
    data = fs.cat_file(path, start=0, end=size + 1)  # one byte more than announced reveals a changed object
    if len(data) != size:
        raise WeightsError(f"{where}: changed while it was read ({size} bytes announced, {len(data)} read)")
    return data


def _read_local(path: str, where: str, max_bytes: int) -> bytes:
    """Opens first, then checks what was opened (no window to swap the file); O_NONBLOCK keeps a FIFO's
    open from waiting for a writer. A deployment run's file is reached from its allowed root, never through a
    link (checkpointing/io/confine.py)."""
    try:
        if confine.local_roots() is not None:
            fd = confine.open_file(path, os.O_RDONLY | os.O_NONBLOCK, where)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise WeightsError(f"{where}: no such file") from exc
    except OSError as exc:
        raise WeightsError(f"{where}: cannot be opened ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WeightsError(
                f"{where}: not a regular file (a {_kind(st.st_mode)}); refusing to read it: name a weights "
                f"file or a checkpoint folder"
            )
        _check_size(st.st_size, where, max_bytes)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(st.st_size + 1)
    finally:
        os.close(fd)
    if len(data) != st.st_size:
        raise WeightsError(f"{where}: changed while it was read ({st.st_size} bytes announced, {len(data)} read)")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "directory" if stat.S_ISDIR(mode) else "socket" if stat.S_ISSOCK(mode) else "special file"


def _check_size(size: int, where: str, max_bytes: int) -> None:
    if size == 0:
        raise WeightsError(f"{where}: the file is empty")
    if size > max_bytes:
        raise WeightsError(
            f"{where}: {size / 1e9:.2f} GB is more than this worker loads ({max_bytes / 1e9:.2f} GB, half its memory)"
        )


# -- formats ---------------------------------------------------------------------------------------
def is_safetensors(data: bytes) -> bool:
    """safetensors' layout: an 8-byte little-endian header length, then a JSON header."""
    if len(data) < 10:
        return False
    n = int.from_bytes(data[:8], "little")
    return 2 <= n <= len(data) - 8 and data[8:9] == b"{"


def safetensors_metadata(data: bytes) -> dict[str, Any]:
    """The header's ``__metadata__`` (string to string); JSON values (recipe_args, progress) decoded."""
    n = int.from_bytes(data[:8], "little")
    raw = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    metadata: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            metadata[key] = json.loads(value) if key in ("recipe_args", "progress") else value
        except ValueError:
            metadata[key] = value
    return metadata


def _torch_load(data: bytes, where: str) -> Any:
    """``safe_load`` with the peers' harmless types (``checkpointing.peers.safe_types``); refusals keep their type."""
    try:
        return load_with_peer_types(data, where)
    except (UnsafeCheckpointError, WeightsError):
        raise
    except Exception as exc:  # a damaged zip (RuntimeError), or a pickle whose opcodes make no sense (stack, memo)
        raise WeightsError(
            f"{where}: not a readable torch.save file (damaged, truncated or malformed: {type(exc).__name__})"
        ) from exc


def _is_state_dict(obj: Any) -> bool:
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(k, str) for k in obj):
        return False
    return all(isinstance(v, torch.Tensor) or k.endswith("_extra_state") for k, v in obj.items())


def unwrap(obj: Any, where: str) -> Weights:
    """Finds the model's state_dict in the layouts other tools write."""
    if _is_state_dict(obj):
        return Weights(dict(obj), "a plain state_dict")
    if isinstance(obj, Mapping):
        state = obj.get("state")
        if isinstance(state, Mapping) and _is_state_dict(state.get("model")):
            return Weights(dict(state["model"]), "a Composer-style checkpoint (['state']['model'])")
        if _is_state_dict(obj.get("model")):
            metadata = obj.get("metadata")
            if isinstance(metadata, Mapping):
                return Weights(dict(obj["model"]), "an export of this product (['model'])", dict(metadata))
            return Weights(dict(obj["model"]), "a checkpoint's ['model']")
        if _is_state_dict(obj.get("state_dict")):
            return Weights(dict(obj["state_dict"]), "a Lightning-style checkpoint (['state_dict'])")
        for key in _USER_KEYS:  # what torch.save'd training dicts (Ray Train's guides, PyTorch's tutorials) use
            if _is_state_dict(obj.get(key)):
                return Weights(dict(obj[key]), f"a checkpoint's [{key!r}]")
    # what was found, by kind and size only: the file may be another team's, its keys are its content
    found = f"a mapping of {len(obj)} keys" if isinstance(obj, Mapping) else f"a {type(obj).__name__}"
    raise WeightsError(
        f"{where}: holds no state_dict in a layout this reader knows (found {found}); expected {LAYOUTS}"
    )


# What ``unwrap`` looks for, for people (export's error names it too): written from the keys it tries.
LAYOUTS = (
    ", ".join(
        ["a state_dict", "{'model': ...}", "{'state': {'model': ...}}", "{'state_dict': ...}"]
        + [f"{{{k!r}: ...}}" for k in _USER_KEYS[:-1]]
    )
    + f" or {{{_USER_KEYS[-1]!r}: ...}}"
)


def _strip_wrapper_prefixes(state_dict: dict[str, Any], model_keys: set[str]) -> tuple[dict[str, Any], str]:
    """Peels wrapper prefixes (nested ones too, e.g. DDP around torch.compile) that wrap every key of the file
    and none of the model's; kept only if the result then shares keys with the model."""
    candidate, stripped = state_dict, ""
    while candidate:
        prefix = next(
            (
                p
                for p in WRAPPER_PREFIXES
                if all(k.startswith(p) for k in candidate) and not any(m.startswith(p) for m in model_keys)
            ),
            None,
        )
        if prefix is None:
            break
        candidate, stripped = {k[len(prefix) :]: v for k, v in candidate.items()}, stripped + prefix
        if candidate.keys() & model_keys:
            return candidate, stripped
    return state_dict, ""


def _examples(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_EXAMPLES])
    return shown + (", ..." if len(keys) > _EXAMPLES else "")
