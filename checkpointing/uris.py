"""Checkpoints and runs named by URI (``load_path``, ``resume_from``'s run, a release, ``python -m checkpointing``):
``<save_folder>/<run_name>[/checkpoints/<name>[/manifest.json]]``, split and opened through ``CheckpointStore``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from checkpointing.errors import NotACheckpointError
from checkpointing.manifest import MANIFEST, validate_name
from checkpointing.pointer import POINTER
from checkpointing.store import CHECKPOINTS, CheckpointStore, LoadedCheckpoint


def split_run_uri(uri: str) -> tuple[str, str, str | None]:
    """``<save_folder>/<run_name>[/checkpoints/<name>[/manifest.json]]`` -> (save_folder, run_name, name)."""
    uri = str(uri).rstrip("/").removesuffix(f"/{MANIFEST}").rstrip("/")
    name = None
    if f"/{CHECKPOINTS}/" in uri:
        uri, name = uri.rsplit(f"/{CHECKPOINTS}/", 1)
    if "/" not in uri:
        raise NotACheckpointError(f"{uri!r}: give <save_folder>/<run_name>, e.g. runs/exp1 or s3://bucket/runs/exp1")
    folder, run = uri.rsplit("/", 1)
    return folder, run, name


def open_checkpoint_uri(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    option: str = "load_path",
) -> LoadedCheckpoint:
    """Loads a checkpoint named by URI: a checkpoint folder, or a run folder (its latest good one)."""
    try:
        folder, run, name = split_run_uri(uri)
        store = CheckpointStore(folder, validate_name(run, option), storage_options=storage_options)
    except ValueError as exc:
        raise NotACheckpointError(f"{option}={uri!r}: {exc}") from exc
    if name is not None:
        if store.info(validate_name(name, option)) is None:
            raise NotACheckpointError(f"{option}={uri!r}: no checkpoint with a readable {MANIFEST} there")
        return store.load(name, files)
    if store.storage.exists(POINTER) or store.storage.exists(CHECKPOINTS):
        loaded = store.load_latest(files)
        if loaded is not None:
            return loaded
        raise NotACheckpointError(f"{option}={uri!r}: the run there has no checkpoint that verifies")
    raise NotACheckpointError(
        f"{option}={uri!r}: neither a checkpoint folder (with {MANIFEST}) nor a run folder "
        f"(with '{POINTER}' or '{CHECKPOINTS}/'); point it at <save_folder>/<run_name> or "
        f"<save_folder>/<run_name>/{CHECKPOINTS}/<name>"
    )
