"""A committed checkpoint copied elsewhere in the same store, server-side where the store can (PBT's exploit).

A copy is committed like a checkpoint: the source's manifest and file sizes are checked first, every file the
manifest vouches for is copied, the copy's sizes are checked, and the manifest goes last (it is copied byte for
byte, so its checksum and every file's sha256 stay the source's, and a load of the copy verifies them). Until the
manifest lands the copy is no checkpoint, so a copy killed half-way is simply done again: copying over a partial
copy first removes the copy's manifest, then rewrites every file.

On S3, ``Storage.copy`` is a CopyObject request: no byte of the checkpoint passes through this process.
"""

from __future__ import annotations

from checkpointing.errors import CorruptCheckpointError, ManifestError
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import MAX_MANIFEST_BYTES
from checkpointing.manifest import MANIFEST, FileEntry, Manifest
from checkpointing.store import size_problem


def copy_checkpoint(storage: Storage, source_key: str, target_key: str) -> str:
    """Copies the checkpoint folder ``source_key`` to ``target_key`` (both relative to ``storage``'s root, e.g.
    ``t001/checkpoints/<name>`` and ``sweep/exploits/t003-e1/checkpoints/<name>``); returns the copy's URI.
    CorruptCheckpointError when the source does not verify, or the copy did not land whole."""
    source_key, target_key = source_key.strip("/"), target_key.strip("/")
    for key in (source_key, target_key):  # a key reads as written on S3 and resolved locally: inside the store only
        if any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"copy_checkpoint: {key[:300]!r} has '.', '..' or empty segments; name a key in the store")
    if source_key == target_key:
        raise ValueError(f"copy_checkpoint: source and target are the same ({source_key!r})")
    manifest = _verified_manifest(storage, source_key)
    storage.delete(f"{target_key}/{MANIFEST}")  # a copy over an earlier one is no checkpoint until it is done
    for fname in manifest.files:
        storage.copy(f"{source_key}/{fname}", f"{target_key}/{fname}")
    problems = size_problems(storage, target_key, manifest.files)
    if problems:
        raise CorruptCheckpointError(
            f"the copy of {storage.uri(source_key)} at {storage.uri(target_key)} did not land whole "
            f"({'; '.join(problems)}); it was not committed: copy it again"
        )
    storage.copy(f"{source_key}/{MANIFEST}", f"{target_key}/{MANIFEST}")
    if _manifest(storage, target_key).files != manifest.files:
        raise CorruptCheckpointError(
            f"{storage.uri(target_key)}/{MANIFEST} changed while it was copied (the source was rewritten?); copy again"
        )
    return storage.uri(target_key)


def size_problems(storage: Storage, key: str, files: dict[str, FileEntry]) -> list[str]:
    """What is wrong with the files under ``key`` against the sizes the manifest gives (one listing), as
    ``CheckpointStore.check`` reports it; empty when every file is there with its size."""
    found = storage.sizes(key)
    wrong = {fname: size_problem(found.get(fname), entry) for fname, entry in files.items()}
    return [f"{fname}: {problem}" for fname, problem in wrong.items() if problem]


def _verified_manifest(storage: Storage, key: str) -> Manifest:
    manifest = _manifest(storage, key)
    problems = size_problems(storage, key, manifest.files)
    if problems:
        raise CorruptCheckpointError(
            f"{storage.uri(key)} does not verify ({'; '.join(problems)}); copy a checkpoint that does "
            f"(python -m checkpointing verify <run> lists them)"
        )
    return manifest


def _manifest(storage: Storage, key: str) -> Manifest:
    try:
        return Manifest.from_json(storage.get(f"{key}/{MANIFEST}", max_bytes=MAX_MANIFEST_BYTES))
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"{storage.uri(key)}: no {MANIFEST}, so no committed checkpoint; name a checkpoint folder "
            f"(<run>/checkpoints/<name>)"
        ) from exc
    except ManifestError as exc:
        raise CorruptCheckpointError(f"{storage.uri(key)}/{MANIFEST}: {exc}; copy another checkpoint") from exc
