"""Suggested product changes, prototyped here so that their gain can be measured before anyone edits the
product (training/ and checkpointing/ are being edited by others). ``applied()`` swaps them in for the
duration of a ``with`` block; nothing is patched outside it. See bench/RESULTS.md for what they measure.

1. ``CheckpointStore.load``: read each file whole (one buffer, as plain fsspec does) and hash it on a helper
   thread *while* ``torch.load(weights_only=True)`` unpickles it, instead of reading in chunks hashed
   between reads and joining them (a second copy of the checkpoint) before unpickling. A file whose size
   or sha256 does not match is still refused: its objects are dropped and CorruptCheckpointError raised.
   Unpickling bytes before they are verified is safe because ``weights_only=True`` runs no code.
2. ``serialize``: torch.save without its zip CRC-32 (``torch.serialization.set_crc32_options(False)``): the
   manifest's sha256 already covers every byte, and the CRC is about a quarter of torch.save's time.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable
from typing import Any

import torch

import checkpointing.store as store_module
import training.unit.session as session_module
from checkpointing.io.hashing import in_background, sha256_hex
from checkpointing.store import CheckpointInfo, CorruptCheckpointError, LoadedCheckpoint, safe_load


def load_hashing_while_unpickling(
    self, checkpoint: str | CheckpointInfo, files: Iterable[str] | None = None
) -> LoadedCheckpoint:
    info = checkpoint if isinstance(checkpoint, CheckpointInfo) else self.info(checkpoint)
    if info is None:
        raise CorruptCheckpointError(f"{self.uri}/{store_module.CHECKPOINTS}/{checkpoint}: no readable manifest")
    wanted = list(info.manifest.files) if files is None else list(files)
    objects = {}
    for fname in wanted:
        entry = info.manifest.files.get(fname)
        if entry is None:
            continue
        try:
            data = self.storage.get(f"{self._key(info.name)}/{fname}")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{info.uri}/{fname}: missing") from exc
        if len(data) != entry.size:
            raise CorruptCheckpointError(f"{info.uri}/{fname}: {len(data)} bytes, manifest says {entry.size}")
        digest = in_background(sha256_hex, data)
        try:
            obj, error = safe_load(data, f"{info.uri}/{fname}"), None
        except Exception as exc:
            obj, error = None, exc
        if digest.result() != entry.sha256:
            raise CorruptCheckpointError(f"{info.uri}/{fname}: sha256 does not match the manifest")
        if error is not None:
            raise error
        objects[fname] = obj
    return LoadedCheckpoint(info=info, objects=objects)


def serialize_without_crc32(objects: dict[str, Any]) -> dict[str, bytes]:
    blobs = {}
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        for fname, obj in objects.items():
            buf = io.BytesIO()
            torch.save(obj, buf)
            blobs[fname] = buf.getvalue()
    finally:
        torch.serialization.set_crc32_options(previous)
    return blobs


@contextlib.contextmanager
def applied():
    saved = (store_module.CheckpointStore.load, store_module.serialize, session_module.serialize)
    store_module.CheckpointStore.load = load_hashing_while_unpickling
    store_module.serialize = session_module.serialize = serialize_without_crc32
    try:
        yield
    finally:
        store_module.CheckpointStore.load, store_module.serialize, session_module.serialize = saved
