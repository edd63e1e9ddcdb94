"""``latest``: the pointer to a run's newest committed checkpoint, read as untrusted input.

It names a checkpoint (a path segment: a name like ``../other-run/...`` must not lead the reader out of the
run), the generation of the writer that moved it and the sha256 of the manifest it vouches for. It is read
bounded (untrusted.py) and typed; a ``latest`` that is missing reads as FileNotFoundError, a damaged one as
DamagedFileError, and the store then lists every checkpoint (store.py). Only a writer rewrites it: a commit,
a roll-back, or ``CheckpointStore._repair_pointer`` when it is damaged.
"""

from __future__ import annotations

import json
import re
from typing import Any

from checkpointing.errors import DamagedFileError
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import MAX_INT, MAX_POINTER_BYTES, as_dict, as_int, read_json
from checkpointing.manifest import validate_name

POINTER = "latest"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def read(storage: Storage) -> dict[str, Any]:
    """{"name", "generation", "manifest_sha256"}; FileNotFoundError or DamagedFileError."""
    raw = as_dict(read_json(storage, POINTER, MAX_POINTER_BYTES), POINTER)
    sha = raw.get("manifest_sha256", "")
    try:
        name = validate_name(raw.get("name"), "latest name")  # type: ignore[arg-type]  # it checks the type too
    except ValueError as exc:  # its message shows the name as repr() does: escaped
        raise DamagedFileError(str(exc)[:300]) from exc
    if not isinstance(sha, str) or (sha and not _SHA256.match(sha)):
        raise DamagedFileError("its manifest_sha256 is not 64 hex digits")
    return {"name": name, "generation": as_int(raw.get("generation", 0), "generation", MAX_INT), "manifest_sha256": sha}


def write(storage: Storage, name: str, generation: int, manifest_sha256: str) -> None:
    pointer = {"name": name, "generation": generation, "manifest_sha256": manifest_sha256}
    storage.put(POINTER, json.dumps(pointer).encode())
