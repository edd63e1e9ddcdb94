"""The manifest: the one file that vouches for a checkpoint.

A checkpoint counts only once its ``manifest.json`` exists, and a reader trusts no byte the manifest
does not describe (size + sha256). The manifest also says where training stood (progress counters,
world size, global batch size) so that resolving the latest checkpoint needs no big download.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A manifest is missing, torn or of a format this code cannot read."""


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
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            version = raw["format_version"]
            if version > FORMAT_VERSION:
                raise ManifestError(
                    f"format_version {version} is newer than this code ({FORMAT_VERSION}); upgrade to read it"
                )
            return cls(
                name=raw["name"],
                files={k: FileEntry(**v) for k, v in raw["files"].items()},
                progress={k: int(v) for k, v in raw["progress"].items()},
                metadata=raw.get("metadata", {}),
                writer=Writer(**raw["writer"]),
                created_at=float(raw["created_at"]),
                format_version=version,
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"unreadable manifest: {type(exc).__name__}: {exc}") from exc


def describe(data: bytes) -> FileEntry:
    return FileEntry(size=len(data), sha256=hashlib.sha256(data).hexdigest())
