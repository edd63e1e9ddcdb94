"""Exports: one checkpoint's weights in one file, with what rebuilds the model written beside them.

An export is for use outside this product (inference, another trainer, a warm start elsewhere), so it
carries the recipe's import path, its ``recipe_args`` and the product version: ``recipe(**recipe_args)
.build_model()`` plus the file gives the model back with no other knowledge. Two formats:

- ``torch``: ``torch.save({"model": state_dict, "metadata": {...}})``, read back with
  ``torch.load(f, weights_only=True)["model"]``;
- ``safetensors``: the tensors, with the metadata as strings in the file's header (JSON for
  ``recipe_args`` and ``progress``) — a format with no code in it at all.

The CLI (``python -m checkpointing export``) and the flow's ``export_on_complete`` both call
``export_checkpoint``.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import os
import tempfile
from typing import Any

import safetensors.torch
import torch

from checkpointing.errors import CorruptCheckpointError, NotACheckpointError, WeightsError
from checkpointing.io import confine
from checkpointing.io.protocols import is_local_fs, open_url
from checkpointing.io.storage import Storage
from checkpointing.peers.weights import LAYOUTS, unwrap
from checkpointing.store import STATE_FILE, CheckpointInfo, CheckpointStore, validate_name
from checkpointing.uris import split_run_uri

FORMATS = ("torch", "safetensors")
log = logging.getLogger(__name__)
PACKAGE = "resumable-train"


def export_checkpoint(
    checkpoint_uri: str,
    out_uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    fmt: str | None = None,
) -> str:
    """Writes the weights of a checkpoint (or of a run's latest good one) to ``out_uri``; returns a line
    saying what was written. ``fmt`` defaults to safetensors for a ``.safetensors`` name, else torch."""
    fmt = fmt or ("safetensors" if str(out_uri).endswith(".safetensors") else "torch")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: use one of {', '.join(FORMATS)}")
    weights, info = model_weights(checkpoint_uri, storage_options)
    metadata = export_metadata(info)
    if fmt == "safetensors":
        data = safetensors.torch.save(_own_storage(weights, out_uri), metadata=_as_strings(metadata))
        how = "safetensors.torch.load_file(f)"
    else:
        buf = io.BytesIO()
        torch.save({"model": weights, "metadata": metadata}, buf)
        data, how = buf.getvalue(), "torch.load(f, weights_only=True)['model']"
    write_file(out_uri, data, storage_options)
    return (
        f"exported the weights of {info.uri} to {out_uri} ({how}); recipe {metadata['recipe']!r}, "
        f"recipe_args {metadata['recipe_args']!r}, {PACKAGE} {metadata['product_version']}"
    )


def model_weights(uri: str, storage_options: dict[str, Any] | None) -> tuple[dict[str, Any], CheckpointInfo]:
    """The model state_dict of the checkpoint ``uri`` names (a checkpoint folder, or a run folder's newest one
    that loads), whether it is one ``state.pt`` or DCP shards (consolidated here)."""
    try:
        folder, run, name = split_run_uri(uri)
        store = CheckpointStore(folder, validate_name(run, "uri"), storage_options=storage_options)
    except ValueError as exc:
        raise NotACheckpointError(f"uri={uri!r}: {exc}") from exc
    found = [store.info(validate_name(name, "uri"))] if name is not None else list(store.candidates())
    no_weights = ""  # the newest checkpoint that verified but holds no weights: why
    for info in found:
        if info is None:
            break
        try:
            if info.manifest.metadata.get("format") == "dcp":
                from checkpointing.commit.sharded import consolidated_model  # DCP: slow to import, only for these

                return consolidated_model(store, info), info
            return _model_of(store.load(info, files=[STATE_FILE]).objects.get(STATE_FILE), info), info
        except CorruptCheckpointError as exc:
            if name is not None:
                raise
            no_weights = no_weights or (str(exc) if isinstance(exc, _NoWeights) else "")
            log.warning("skipping checkpoint %s: %s", info.name, exc)
    if no_weights:
        raise NotACheckpointError(f"uri={uri!r}: no checkpoint there holds model weights; the newest that verifies: "
                                  f"{no_weights}")  # fmt: skip
    raise NotACheckpointError(f"uri={uri!r}: no checkpoint there that verifies")


class _NoWeights(CorruptCheckpointError):
    """A checkpoint that verifies but whose state holds no weights in a layout ``load_path`` reads."""


def _model_of(state: Any, info: CheckpointInfo) -> dict[str, Any]:
    """The weights in ``state["state"]``, looked for as ``load_path`` looks for them in a file (``unwrap``: the train
    loop's ``["model"]``, an own loop's ``["model_weights"]``, ...); _NoWeights (the next checkpoint is tried) when
    they are not there."""
    where = f"{info.uri}/{STATE_FILE}"
    inner = state.get("state") if isinstance(state, dict) else None
    if inner is None:
        raise _NoWeights(f"{where}: holds no ['state'] (looked for the weights under it: {LAYOUTS})")
    try:
        return unwrap(inner, f"{where} ['state']").state_dict
    except WeightsError as exc:
        raise _NoWeights(str(exc)) from exc


def export_metadata(info: CheckpointInfo) -> dict[str, Any]:
    """What rebuilds the model: recipe and recipe_args from the manifest, plus where the weights came from."""
    saved = info.manifest.metadata
    config = saved.get("config")
    recipe_args = config.get("recipe_args") if isinstance(config, dict) else None
    if recipe_args is None:
        recipe_args = saved.get("recipe_args")
    return {
        "recipe": str(saved.get("recipe", "")),
        "recipe_args": recipe_args,
        "product_version": product_version(),
        "checkpoint": info.uri,
        "progress": dict(info.progress),
    }


def product_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def write_file(uri: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Writes a whole file. Locally through a temporary file and a rename: a reader never sees half a file,
    and an existing symlink or FIFO at the name is replaced, never written through. Object stores put the
    object whole (retried like every store call)."""
    fs, path = open_url(uri, storage_options)
    if not is_local_fs(fs):
        Storage(uri, storage_options).put("", data)
        return
    if confine.local_roots() is not None:
        _write_confined(uri, path, data)
        return
    if os.path.isdir(path):
        raise WeightsError(f"{uri!r} is a folder; name the file to write, e.g. {uri.rstrip('/')}/model.pt")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".export-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_confined(uri: str, path: str, data: bytes) -> None:
    """A deployment run's export: written by ``LocalFiles`` from the allowed root, through no link (a folder that
    became one since the run started is refused), at the moment of the write."""
    where = f"export_on_complete={uri!r}"
    if confine.kind(path, where) == "dir":
        raise WeightsError(f"{uri!r} is a folder; name the file to write, e.g. {uri.rstrip('/')}/model.pt")
    folder, name = os.path.split(os.path.abspath(path))
    confine.local_files(folder, where).write(name, data)  # 0o644, as the other exports


def _as_strings(metadata: dict[str, Any]) -> dict[str, str]:
    """safetensors' header holds strings only: structured values as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}


def _own_storage(state_dict: dict[str, Any], out_uri: str) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights) or views: give those their own copy."""
    seen: set[int] = set()
    tensors = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise WeightsError(
                f"{out_uri!r}: {key!r} is not a tensor; safetensors holds tensors only: use --format torch"
            )
        storage = value.untyped_storage()
        whole = value.is_contiguous() and storage.nbytes() == value.numel() * value.element_size()
        tensors[key] = (
            value
            if whole and storage.data_ptr() not in seen
            else value.detach().clone(memory_format=torch.contiguous_format)
        )
        seen.add(storage.data_ptr())
    return tensors
