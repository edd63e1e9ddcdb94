"""What the hostile-store tests share: a small run on a real store, and ways to forge what a bucket holds."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import torch

from checkpointing import CheckpointStore, Writer
from checkpointing.manifest import Manifest

NAMES = [f"ep{i}-ba{8 * i}-sa{256 * i}" for i in range(1, 5)]
DEEP = b"[" * 100_000  # json.loads: RecursionError


def run_of(backend, epochs: int = 3, run_name: str = "r") -> CheckpointStore:
    """A run of ``epochs`` units committed by writer generation 1, on ``backend`` (save_folder, options)."""
    folder, options = backend
    store = CheckpointStore(folder, run_name, storage_options=options)
    for epoch in range(1, epochs + 1):
        save(store, epoch, 1)
    return store


def save(store: CheckpointStore, epoch: int, generation: int, name: str | None = None, loss: float = 1.0) -> str:
    name = name or NAMES[epoch - 1]
    store.save(
        name,
        {"state.pt": {"state": {"model": {"w": torch.full((4,), float(epoch))}}, "progress": progress(epoch)}},
        progress=progress(epoch),
        metadata={"metrics": {"loss": loss}},
        writer=Writer.current(generation),
    )
    return name


def progress(epoch: int) -> dict[str, int]:
    return {"epoch": epoch, "step": 8 * epoch, "samples_seen": 256 * epoch}


def weights_of(store: CheckpointStore, loaded) -> float:
    return float(loaded.objects["state.pt"]["state"]["model"]["w"][0])


def forge_manifest(store: CheckpointStore, name: str, change) -> None:
    """Rewrites checkpoint ``name``'s manifest with ``change(raw dict)`` applied and a checksum that matches:
    what someone who can write the bucket can do."""
    raw = json.loads(store.storage.get(f"checkpoints/{name}/manifest.json"))
    raw.pop("checksum")
    change(raw)
    store.storage.put(f"checkpoints/{name}/manifest.json", json.dumps({**raw, "checksum": checksum(raw)}).encode())


def checksum(body: dict) -> str:
    """The sha256 a manifest or a roll-back record carries of its own content (canonical JSON)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def vouch(store: CheckpointStore, name: str, files: dict[str, bytes]) -> None:
    """Puts ``files`` into checkpoint ``name`` and a manifest (checksum and all) that vouches for them."""
    info = store.info(name)
    entries = dict(info.manifest.files)
    for fname, data in files.items():
        store.storage.put(f"checkpoints/{name}/{fname}", data)
        entries[fname] = type(next(iter(entries.values())))(len(data), hashlib.sha256(data).hexdigest())
    manifest = Manifest(**{**info.manifest.__dict__, "files": entries})
    store.storage.put(f"checkpoints/{name}/manifest.json", manifest.to_json())


def deflated(data: bytes) -> bytes:
    """A real torch.save zip rewritten with every entry deflate-compressed (torch.load still reads it)."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            target.writestr(item.filename, source.read(item.filename), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
