"""The shard index of a streaming dataset: which shards, in which order, how many samples each, and what each holds.

Samples are addressed by one global integer id (shard 0's samples first, then shard 1's, ...), so the product's data
position (samples seen, sample in epoch) applies to a folder of shards exactly as it does to a map-style dataset: exact
across kills, global batch size changes and world size changes.

The index is ``shards.index.json`` beside the data, written once by the first run that opens the folder (a folder that
cannot be written to keeps it in memory). It is read like anything else from a bucket: bounded, typed, and checked
against the folder's listing on every open. A shard whose size changed, a shard missing, a shard the index does not
know, or a sample count the shard's size cannot hold stops the run with one line: any of these would shift every later
sample id, and training on would silently repeat or skip data (or allocate what a forged count asks for).

Each shard's content has a fingerprint in the index (format 2), checked whenever the shard is read (into the cache, or
opened in place), so a shard rewritten with other bytes of the same size stops the run in one line instead of being
trained on as the data a resume believes it continues:

- on S3, the object's ETag from the listing (``etag:...``): free (the listing is read on every open anyway, and a
  changed ETag is refused there), and binding: s3fs reads every byte range with ``If-Match`` on the ETag it opened, so
  the bytes copied into the cache are the object the index names, with no hash to compute. A version id is not used:
  it exists only in versioned buckets, and the ETag changes with the content in every bucket.
- elsewhere (a local folder, other stores), a sha256 of the bytes taken when the index is built (``sha256:...``): no
  listing there says anything about content. SHA-256 (hardware-accelerated, ~1.7 GB/s here) costs one read of each
  shard at build and one per process at its first open (a local shard is then verified once per process while its
  inode, size and times stay the same); a remote shard is hashed while it is copied into the cache.

An index of format 1 (no fingerprints, written before them) keeps working, with one warning per open naming it and the
fix (delete it to have it rebuilt with fingerprints, for a new run: a run's checkpoints may record its index), rather
than stopping runs in progress over data that did not change.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import IO, Any

from checkpointing.errors import DamagedFileError
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import parse_json
from training.exceptions import DataError

log = logging.getLogger(__name__)

INDEX_FILE = "shards.index.json"
INDEX_FORMAT = 2  # rows [name, bytes, samples, fingerprint]
OLD_FORMAT = 1  # rows [name, bytes, samples]: read, with a warning
MAX_INDEX_BYTES = 64 << 20
MAX_SHARDS = 1_000_000
MAX_SAMPLES = 1 << 48
# A shard's name: one path part of printable characters (no folder, no "..", nothing a terminal would interpret).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}")
_FINGERPRINT = re.compile(r"(etag:[A-Za-z0-9_.+=/-]{1,200}|sha256:[0-9a-f]{64})")
_ETAG_PROTOCOLS = ("s3",)  # stores whose reads are bound to the listed ETag (s3fs: If-Match on every range)
_CHUNK = 8 << 20
_verified: dict[tuple[int, ...], str] = {}  # this process's local shards already hashed: (dev, ino, ...) -> fingerprint


@dataclass(frozen=True)
class Shard:
    name: str
    size: int  # bytes, as the store lists it
    samples: int
    fingerprint: str | None = None  # "etag:<ETag>" or "sha256:<hex>"; None in an index of format 1


@dataclass(frozen=True)
class ShardIndex:
    """The shards in id order, and what the format needs to read them (``params``: block size, dtype)."""

    kind: str
    params: dict[str, Any]
    shards: tuple[Shard, ...]
    format: int = field(default=INDEX_FORMAT)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", [0, *accumulate(s.samples for s in self.shards)])

    @property
    def starts(self) -> list[int]:
        """Global id of each shard's first sample, and the total at the end."""
        return self._starts  # type: ignore[attr-defined]

    @property
    def num_samples(self) -> int:
        return self.starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, sample in shard) of global sample id ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is outside this dataset of {self.num_samples} samples")
        j = bisect.bisect_right(self.starts, i) - 1
        return j, i - self.starts[j]

    def to_json(self) -> bytes:
        """The index as written (an index read in format 1 stays format 1: a run's checkpoints may hash it)."""
        rows: list[list[Any]] = [[s.name, s.size, s.samples] for s in self.shards]
        if self.format != OLD_FORMAT:
            rows = [[*row, s.fingerprint] for row, s in zip(rows, self.shards, strict=True)]
        body = {"format": self.format, "kind": self.kind, "params": self.params, "shards": rows}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ShardIndex:
        """Parses an index read from a store: bounded and typed; anything else is one DataError."""
        try:
            body = parse_json(data, MAX_INDEX_BYTES, allow_nan=False)
        except DamagedFileError as exc:
            raise DataError(f"{where}: {exc}; delete it to have it rebuilt") from None
        ok = isinstance(body, dict) and body.get("format") in (INDEX_FORMAT, OLD_FORMAT)
        ok = ok and isinstance(body.get("kind"), str) and isinstance(body.get("params"), dict)
        rows = body.get("shards") if ok else None
        if not ok or not isinstance(rows, list) or len(rows) > MAX_SHARDS:
            raise DataError(f"{where}: not a shard index of format {INDEX_FORMAT}; delete it to have it rebuilt")
        version = body["format"]
        shards = [_shard(row, version, where) for row in rows]
        return cls(body["kind"], body["params"], tuple(shards), version)


def _shard(row: Any, version: int, where: str) -> Shard:
    width = 3 if version == OLD_FORMAT else 4
    if not (
        isinstance(row, list)
        and len(row) == width
        and isinstance(row[0], str)
        and _NAME.fullmatch(row[0])
        and all(type(v) is int and 0 <= v <= MAX_SAMPLES for v in row[1:3])
        and (width == 3 or (isinstance(row[3], str) and _FINGERPRINT.fullmatch(row[3])))
    ):
        shape = "[name, bytes, samples]" if width == 3 else "[name, bytes, samples, fingerprint]"
        raise DataError(f"{where}: a shard entry is not {shape}; delete it to have it rebuilt")
    return Shard(row[0], row[1], row[2], row[3] if width == 4 else None)


def listed_shards(storage: Storage, extensions: tuple[str, ...]) -> dict[str, int]:
    """The folder's shards (files directly in it with one of ``extensions``), name -> bytes, in name order."""
    return {name: size for name, (size, _) in listing(storage, extensions).items()}


def listing(storage: Storage, extensions: tuple[str, ...]) -> dict[str, tuple[int, str | None]]:
    """The folder's shards, name -> (bytes, the store's ETag where its reads are bound to it, else None)."""
    found = {}
    for name, (size, etag) in sorted(_listed(storage).items()):
        if "/" in name or not name.endswith(extensions):
            continue
        if not _NAME.fullmatch(name):
            raise DataError(
                f"{storage.url}: a shard's name has characters this reader does not take "
                f"(letters, digits and _ . + = - only); rename it"
            )
        if size < 0:
            raise DataError(f"{storage.uri(name)} is a link or not a regular file; shards are read only as files")
        found[name] = (size, etag)
    return found


def _listed(storage: Storage) -> dict[str, tuple[int, str | None]]:
    if storage.is_local or storage.protocol not in _ETAG_PROTOCOLS:
        return {name: (size, None) for name, size in storage.sizes("").items()}
    base = storage.path("").rstrip("/") + "/"

    def find() -> dict[str, tuple[int, str | None]]:  # Storage.sizes, keeping each object's ETag
        storage.fs.invalidate_cache()
        found = storage.fs.find(base, detail=True)
        return {
            p[len(base) :]: (int(info.get("size") or 0), _etag(info))
            for p, info in found.items()
            if info.get("type", "file") == "file"
        }

    return storage.retried("list ", find)  # one retried call, as Storage.sizes makes it


def _etag(info: dict[str, Any]) -> str | None:
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    return etag if etag and _FINGERPRINT.fullmatch(f"etag:{etag}") else None


def open_index(
    storage: Storage,
    kind: str,
    params: dict[str, Any],
    extensions: tuple[str, ...],
    count: Callable[[str, int], int],
    max_samples: Callable[[int], int] | None = None,
) -> ShardIndex:
    """The folder's index: read and checked against the listing, or built (``count(name, size)`` gives a shard's
    samples, then its content is fingerprinted) and written beside the data when it is missing. ``max_samples(size)``:
    the most samples a shard of ``size`` bytes can hold in this format (default: one byte a sample); a declared count
    above it is recounted, and refused unless the shard really holds it."""
    listed = listing(storage, extensions)
    if not listed:
        raise DataError(
            f"{storage.url}: no {kind} shards there (files ending {' or '.join(extensions)}); check the data url"
        )
    where = storage.uri(INDEX_FILE)
    try:
        data = storage.get(INDEX_FILE, max_bytes=MAX_INDEX_BYTES)
    except FileNotFoundError:
        data = None
    if data is not None:
        index = ShardIndex.from_json(data, where)
        if index.kind != kind or index.params != params:
            raise DataError(
                f"{where} indexes {index.kind} shards with {index.params}, not {kind} with {params}: the sample ids "
                f"would differ; use the same data options, or delete the index for a new run"
            )
        check_listing(index, listed, where, storage)
        check_counts(index, where, storage, count, max_samples or _one_byte_each)
        if index.format == OLD_FORMAT:
            log.warning(
                "%s has no content fingerprints (written before them): a shard rewritten with other bytes of the same "
                "size would not be noticed; delete it before a new run to have it rebuilt with them",
                where,
            )
        return index
    shards = []
    for name, (size, etag) in listed.items():
        samples = count(name, size)
        shards.append(Shard(name, size, samples, f"etag:{etag}" if etag else hash_shard(storage, name)))
    index = ShardIndex(kind, params, tuple(shards))
    try:
        if not storage.create(INDEX_FILE, index.to_json()):  # another process wrote it first: use theirs
            return open_index(storage, kind, params, extensions, count, max_samples)
        log.info("wrote the shard index %s: %d shards, %d samples", where, len(shards), index.num_samples)
    except Exception as exc:  # a read-only bucket: this process keeps the index in memory
        log.info("shard index not written beside the data (%s); kept in memory", type(exc).__name__)
    return index


def check_listing(
    index: ShardIndex, listed: dict[str, tuple[int, str | None]], where: str, storage: Storage | None = None
) -> None:
    """The folder still holds exactly the indexed shards, at their indexed sizes and (where the store lists one)
    with their indexed ETags."""
    names = {s.name for s in index.shards}
    for shard in index.shards:
        if shard.name not in listed:
            raise DataError(
                f"{where}: shard {shard.name} is missing from the folder; restore it (every later sample id "
                f"depends on it)"
            )
        size, etag = listed[shard.name]
        if size != shard.size:
            raise DataError(
                f"{where}: shard {shard.name} is {size} bytes, the index says {shard.size}: the data "
                f"changed under the run; restore it, or start a new run_name and delete the index"
            )
        if etag and shard.fingerprint and shard.fingerprint.startswith("etag:") and shard.fingerprint != f"etag:{etag}":
            raise _rewritten(storage.uri(shard.name) if storage else shard.name, where, f"its ETag is {etag}", shard)
    extra = sorted(set(listed) - names)
    if extra:
        raise DataError(
            f"{where}: {len(extra)} shard(s) the index does not know ({extra[0]}, ...): data added to a folder "
            f"would shift the epoch; put new data in a new folder, or delete the index for a new run"
        )


def check_counts(
    index: ShardIndex, where: str, storage: Storage, count: Callable[[str, int], int], max_samples: Callable[[int], int]
) -> None:
    """Every declared sample count is one the shard's size allows, before anything is allocated for it (a count the
    size does not rule out, above ``max_samples``, is recounted from the shard)."""
    for shard in index.shards:
        most = max_samples(shard.size)
        if shard.samples <= most or count(shard.name, shard.size) == shard.samples:
            continue
        raise DataError(
            f"{storage.uri(shard.name)} is {shard.size} bytes, room for at most {most} samples, but the index {where} "
            f"declares {shard.samples}: the index is damaged or forged; delete it to have it rebuilt"
        )


def _one_byte_each(size: int) -> int:
    return size


def hash_shard(storage: Storage, name: str) -> str:
    """The fingerprint ``sha256:<hex>`` of a shard's bytes, read once (a local shard counts as verified in this
    process until its inode, size or times change)."""
    digest = hashlib.sha256()
    with storage.open_read(name) as f:
        if storage.is_local:
            key = _file_key(f)  # before reading: a change while it is read makes the next open hash it again
            fingerprint = f"sha256:{_digest(f, digest)}"
            _verified[key] = fingerprint
            return fingerprint
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _file_key(f: IO[bytes]) -> tuple[int, ...]:
    st = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_local(shard: Shard, f: IO[bytes], where: str, index: str) -> None:
    """DataError unless the local file ``f`` (a shard opened in place, or its copy in the cache) holds the bytes the
    index fingerprinted. Hashed once per process while the file's inode, size and times stay the same."""
    if shard.fingerprint is None:
        return
    key = _file_key(f)
    if _verified.get(key) == shard.fingerprint:
        return
    kind, _, expected = shard.fingerprint.partition(":")
    if kind == "etag":  # an S3 folder's index beside a local copy: a plain ETag is the MD5 of the bytes
        if "-" in expected:
            raise DataError(
                f"{where}: the index {index} holds S3 multipart ETags, which a local copy cannot be checked against; "
                f"delete the index here to have it rebuilt with hashes"
            )
        found = _digest(f, hashlib.md5(usedforsecurity=False))
    else:
        found = _digest(f, hashlib.sha256())
    if found != expected:
        raise _rewritten(where, index, f"its {'MD5' if kind == 'etag' else 'sha256'} is {found}", shard)
    _verified[key] = shard.fingerprint


def _digest(f: IO[bytes], digest: Any) -> str:
    fd, offset = f.fileno(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return str(digest.hexdigest())


def fetch(storage: Storage, shard: Shard, path: str, index: str) -> int:
    """Copies a remote shard into the local file ``path`` (made, or truncated), checking its fingerprint: an ETag is
    compared with the object opened (whose every byte range s3fs reads with ``If-Match`` on it), a sha256 is taken of
    the bytes copied. Returns the bytes copied (up to one past the indexed size); a mismatch is one DataError."""
    kind, _, expected = (shard.fingerprint or "").partition(":")

    def copy() -> tuple[int, str | None]:
        total, digest = 0, hashlib.sha256() if kind == "sha256" else None
        storage.fs.invalidate_cache(storage.path(shard.name))  # the object as it is now, not a listing's memory
        try:
            with storage.fs.open(storage.path(shard.name), "rb") as src, open(path, "wb") as out:
                etag = _etag(getattr(src, "details", None) or {})
                if kind == "etag" and etag != expected:
                    return total, f"its ETag is {etag}"
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    if digest is not None:
                        digest.update(chunk)
                    total += len(chunk)
                    if total > shard.size:
                        break
        except Exception as exc:
            if type(exc).__name__ == "FileExpired":  # rewritten while it was read: If-Match failed
                return total, "it was rewritten while it was read"
            raise
        if digest is not None and total == shard.size and digest.hexdigest() != expected:
            return total, f"its sha256 is {digest.hexdigest()}"
        return total, None

    total, problem = storage.retried(f"read {shard.name}", copy)  # one retried call, as Storage.download makes it
    if problem:
        raise _rewritten(storage.uri(shard.name), index, problem, shard)
    return total


def cache_folder(url: str, shard: Shard) -> str:
    """The cache's folder for a shard of the folder at ``url``: named by its fingerprint too, so a copy of other
    content (the shard as it was under an older index) is never taken for it."""
    key = url if shard.fingerprint is None else f"{url}\0{shard.fingerprint}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _rewritten(shard: str, index: str, found: str, expected: Shard) -> DataError:
    return DataError(
        f"{shard}: {found}, the index {index} recorded {expected.fingerprint}: the shard was rewritten with other "
        f"content; restore it as it was, or delete the index and start a new run_name"
    )
