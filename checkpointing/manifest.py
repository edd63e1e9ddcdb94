"""The manifest: the one file that vouches for a checkpoint, and for itself.

A checkpoint counts only once its ``manifest.json`` exists, and a reader trusts no byte the manifest
does not describe (size + sha256). The manifest also says where training stood (progress counters,
world size, global batch size) so that resolving the latest checkpoint needs no big download.

Since format 2 the manifest carries a sha256 of its own content (``checksum``): one flipped bit in a
progress counter would otherwise resume from the wrong sample without a word. The ``latest`` pointer
also names the sha256 of the manifest bytes it vouches for. Checksums catch damage, not an attacker
who can write the bucket; what keeps such a person from running code is ``weights_only`` loading, and
what keeps them from stopping every relaunch is that a manifest is read bounded (untrusted.py) and each
field typed: anything else is a ManifestError, and the reader skips that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpointing.errors import DamagedFileError, ManifestError
from checkpointing.io.hashing import sha256_hex
from checkpointing.io.untrusted import (
    MAX_INT,
    MAX_LABEL,
    MAX_MANIFEST_BYTES,
    as_dict,
    as_float,
    as_int,
    as_str,
    parse_json,
)

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILE = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,127}$")
_MAX_HOST = 255  # POSIX HOST_NAME_MAX


def validate_name(value: str, option: str = "run_name") -> str:
    """Names become path segments: reject separators, '..', absolute paths and odd characters."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise ValueError(
            f"{option}={value!r}: use 1-128 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (no '/', '..' or absolute paths)"
        )
    return value


def is_valid_name(value: str) -> bool:
    return bool(_NAME.match(value)) and ".." not in value


def validate_file_name(value: str) -> str:
    """A file of a checkpoint: one path segment; DCP's own names (``.metadata``, ``__0_0.distcp``) included."""
    if not isinstance(value, str) or not _FILE.match(value) or ".." in value:
        raise ValueError(f"checkpoint file name {value!r}: use 1-128 letters, digits, '.', '_' or '-' (no '/' or '..')")
    return value


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
        return cls(host=socket.gethostname(), pid=os.getpid(), generation=generation, label=label[:MAX_LABEL])


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
        """The manifest in ``data`` (at most MAX_MANIFEST_BYTES), every field typed; ManifestError naming the
        problem (never quoting the file) for anything else."""
        try:
            raw = as_dict(parse_json(data, MAX_MANIFEST_BYTES), "the manifest")
            version = raw.get("format_version")
            if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
                raise ManifestError(f"its format_version is newer than this code's ({FORMAT_VERSION}); upgrade")
            version = as_int(version, "format_version", FORMAT_VERSION)
            checksum = raw.pop("checksum", None)
            if version >= 2 and checksum != _checksum(raw):
                raise ManifestError("its content does not match its own checksum: it was altered or damaged")
            return cls(
                name=_name(raw.get("name")),
                files={_file_name(k): _entry(v, k) for k, v in as_dict(raw.get("files"), "files").items()},
                progress={k: _count(v, f"progress[{_quoted(k)}]") for k, v in _keyed(raw.get("progress"), "progress")},
                metadata=_metadata(raw.get("metadata", {})),
                writer=_writer(raw.get("writer")),
                created_at=as_float(raw.get("created_at"), "created_at"),
                format_version=version,
            )
        except ManifestError:
            raise
        except (DamagedFileError, ValueError, RecursionError) as exc:
            raise ManifestError(f"unreadable manifest: {exc}") from exc


def _checksum(body: dict[str, Any]) -> str:
    return sha256_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _count(value: Any, what: str = "a progress counter") -> int:
    return as_int(value, what)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not is_valid_name(value):
        raise DamagedFileError("name is not a valid checkpoint name")
    return value


def _file_name(value: str) -> str:
    if not _FILE.match(value) or ".." in value:
        raise DamagedFileError("files names a file that is not one path segment of letters, digits, '.', '_', '-'")
    return value


def _keyed(value: Any, what: str) -> list[tuple[str, Any]]:
    return list(as_dict(value, what).items())


def _quoted(key: str) -> str:
    """A key from the file, for a message: escaped and cut short (the file is never quoted whole)."""
    return repr(key[:60])


def _entry(value: Any, fname: str) -> FileEntry:
    raw = as_dict(value, f"files[{fname!r}]")
    entry = FileEntry(size=_count(raw.get("size"), f"files[{fname!r}].size"), sha256=str(raw.get("sha256")))
    if not _SHA256.match(entry.sha256):
        raise DamagedFileError(f"files[{fname!r}].sha256 is not 64 hex digits")
    return entry


def _writer(value: Any) -> Writer:
    raw = as_dict(value, "writer")
    return Writer(
        host=as_str(raw.get("host"), "writer.host", _MAX_HOST),
        pid=as_int(raw.get("pid"), "writer.pid"),
        generation=as_int(raw.get("generation", 0), "writer.generation", MAX_INT),
        label=as_str(raw.get("label", ""), "writer.label", MAX_LABEL),
    )


def _metadata(value: Any) -> dict[str, Any]:
    """Free-form (the training layer's), except ``metrics``, which retention, ``best`` and the CLI compare:
    an object of numbers (NaN allowed: a diverged loss is still a loss)."""
    metadata = dict(_keyed(value, "metadata"))
    if metadata.get("metrics") is not None:
        metadata["metrics"] = {
            k: as_float(v, f"metadata.metrics[{_quoted(k)}]", finite=False)
            for k, v in _keyed(metadata["metrics"], "metrics")
        }
    return metadata


def describe(data: bytes) -> FileEntry:
    return FileEntry(size=len(data), sha256=sha256_hex(data))
