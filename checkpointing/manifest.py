"""The manifest: the one file that vouches for a checkpoint, and for itself.

A checkpoint counts only once its ``manifest.json`` exists, and a reader trusts no byte the manifest
does not describe (size + sha256). The manifest also says where training stood (progress counters,
world size, global batch size) so that resolving the latest checkpoint needs no big download.

Since format 2 the manifest carries a sha256 of its own content (``checksum``): one flipped bit in a
progress counter would otherwise resume from the wrong sample without a word. The ``latest`` pointer
also names the sha256 of the manifest bytes it vouches for. Checksums catch damage, not an attacker
who can write the bucket; what keeps such a person from running code is ``weights_only`` loading.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpointing.hashing import sha256_hex

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest is missing, torn, altered or of a format this code cannot read."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Writer:
    """Who wrote a checkpoint. ``generation`` fences stale writers (higher wins)."""

    host: str
    pid: int
    generation: int = 0
    label: str = ""

    @classmethod
    def current(cls, generation: int = 0, label: str = "") -> Writer:
        return cls(host=socket.gethostname(), pid=os.getpid(), generation=generation, label=label)


@dataclass(frozen=True)
class Manifest:
    name: str
    files: dict[str, FileEntry]
    progress: dict[str, int]
    metadata: dict[str, Any] = field(default_factory=dict)
    writer: Writer = field(default_factory=Writer.current)
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def order(self) -> tuple[int, int, float]:
        """Sort key, oldest first: writer generation, then training progress, then wall time.

        Generation first: a newer writer's lineage supersedes a stale writer's, even one that got further
        (or after falling back past a corrupt checkpoint)."""
        return (self.writer.generation, int(self.progress.get("samples_seen", 0)), self.created_at)

    def to_json(self) -> bytes:
        body = asdict(self)
        return json.dumps({**body, "checksum": _checksum(body)}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            version = raw["format_version"]
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise ManifestError(f"format_version {version!r} is newer than this code ({FORMAT_VERSION}); upgrade")
            checksum = raw.pop("checksum", None)
            if version >= 2 and checksum != _checksum(raw):
                raise ManifestError("its content does not match its own checksum: it was altered or damaged")
            return cls(
                name=str(raw["name"]),
                files={str(k): _entry(v) for k, v in raw["files"].items()},
                progress={str(k): _count(v) for k, v in raw["progress"].items()},
                metadata=dict(raw.get("metadata", {})),
                writer=Writer(**raw["writer"]),
                created_at=float(raw["created_at"]),
                format_version=version,
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"unreadable manifest: {type(exc).__name__}: {exc}") from exc


def _checksum(body: dict[str, Any]) -> str:
    return sha256_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"progress counter {value!r} is not a non-negative integer")
    return value


def _entry(value: dict[str, Any]) -> FileEntry:
    entry = FileEntry(size=_count(value["size"]), sha256=str(value["sha256"]))
    if not _SHA256.match(entry.sha256):
        raise ValueError(f"sha256 {entry.sha256[:70]!r} is not 64 hex digits")
    return entry


def describe(data: bytes) -> FileEntry:
    return FileEntry(size=len(data), sha256=sha256_hex(data))
