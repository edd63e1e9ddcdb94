"""The shard index of a streaming dataset: which shards, in which order, how many samples each.

Samples are addressed by one global integer id (shard 0's samples first, then shard 1's, ...), so the product's data
position (samples seen, sample in epoch) applies to a folder of shards exactly as it does to a map-style dataset: exact
across kills, global batch size changes and world size changes.

The index is ``shards.index.json`` beside the data, written once by the first run that opens the folder (a folder that
cannot be written to keeps it in memory; it is cheap to rebuild for token and Parquet shards, one read of every shard
for JSONL). It is read like anything else from a bucket: bounded, typed, and checked against the folder's listing on
every open. A shard whose size changed, a shard missing, or a shard the index does not know stops the run with one line:
any of these would shift every later sample id, and training on would silently repeat or skip data.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from checkpointing.errors import DamagedFileError
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import parse_json
from training.exceptions import DataError

log = logging.getLogger(__name__)

INDEX_FILE = "shards.index.json"
INDEX_FORMAT = 1
MAX_INDEX_BYTES = 64 << 20
MAX_SHARDS = 1_000_000
MAX_SAMPLES = 1 << 48
# A shard's name: one path part of printable characters (no folder, no "..", nothing a terminal would interpret).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}")


@dataclass(frozen=True)
class Shard:
    name: str
    size: int  # bytes, as the store lists it
    samples: int


@dataclass(frozen=True)
class ShardIndex:
    """The shards in id order, and what the format needs to read them (``params``: block size, dtype)."""

    kind: str
    params: dict[str, Any]
    shards: tuple[Shard, ...]

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
        body = {
            "format": INDEX_FORMAT,
            "kind": self.kind,
            "params": self.params,
            "shards": [[s.name, s.size, s.samples] for s in self.shards],
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ShardIndex:
        """Parses an index read from a store: bounded and typed; anything else is one DataError."""
        try:
            body = parse_json(data, MAX_INDEX_BYTES, allow_nan=False)
        except DamagedFileError as exc:
            raise DataError(f"{where}: {exc}; delete it to have it rebuilt") from None
        ok = isinstance(body, dict) and body.get("format") == INDEX_FORMAT
        ok = ok and isinstance(body.get("kind"), str) and isinstance(body.get("params"), dict)
        rows = body.get("shards") if ok else None
        if not ok or not isinstance(rows, list) or len(rows) > MAX_SHARDS:
            raise DataError(f"{where}: not a shard index of format {INDEX_FORMAT}; delete it to have it rebuilt")
        shards = []
        for row in rows:
            if not (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], str)
                and _NAME.fullmatch(row[0])
                and all(type(v) is int and 0 <= v <= MAX_SAMPLES for v in row[1:])
            ):
                raise DataError(f"{where}: a shard entry is not [name, bytes, samples]; delete it to have it rebuilt")
            shards.append(Shard(row[0], row[1], row[2]))
        return cls(body["kind"], body["params"], tuple(shards))


def listed_shards(storage: Storage, extensions: tuple[str, ...]) -> dict[str, int]:
    """The folder's shards (files directly in it with one of ``extensions``), name -> bytes, in name order."""
    sizes = storage.sizes("")
    found = {}
    for name, size in sorted(sizes.items()):
        if "/" in name or not name.endswith(extensions):
            continue
        if not _NAME.fullmatch(name):
            raise DataError(
                f"{storage.url}: a shard's name has characters this reader does not take "
                f"(letters, digits and _ . + = - only); rename it"
            )
        if size < 0:
            raise DataError(f"{storage.uri(name)} is a link or not a regular file; shards are read only as files")
        found[name] = size
    return found


def open_index(
    storage: Storage,
    kind: str,
    params: dict[str, Any],
    extensions: tuple[str, ...],
    count: Callable[[str, int], int],
) -> ShardIndex:
    """The folder's index: read and checked against the listing, or built (``count(name, size)`` gives a shard's
    samples) and written beside the data when it is missing."""
    listed = listed_shards(storage, extensions)
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
        check_listing(index, listed, where)
        return index
    shards = tuple(Shard(name, size, count(name, size)) for name, size in listed.items())
    index = ShardIndex(kind, params, shards)
    try:
        if not storage.create(INDEX_FILE, index.to_json()):  # another process wrote it first: use theirs
            return open_index(storage, kind, params, extensions, count)
        log.info("wrote the shard index %s: %d shards, %d samples", where, len(shards), index.num_samples)
    except Exception as exc:  # a read-only bucket: this process keeps the index in memory
        log.info("shard index not written beside the data (%s); kept in memory", type(exc).__name__)
    return index


def check_listing(index: ShardIndex, listed: dict[str, int], where: str) -> None:
    """The folder still holds exactly the indexed shards, at their indexed sizes."""
    names = {s.name for s in index.shards}
    for shard in index.shards:
        if shard.name not in listed:
            raise DataError(
                f"{where}: shard {shard.name} is missing from the folder; restore it (every later sample id "
                f"depends on it)"
            )
        if listed[shard.name] != shard.size:
            raise DataError(
                f"{where}: shard {shard.name} is {listed[shard.name]} bytes, the index says {shard.size}: the data "
                f"changed under the run; restore it, or start a new run_name and delete the index"
            )
    extra = sorted(set(listed) - names)
    if extra:
        raise DataError(
            f"{where}: {len(extra)} shard(s) the index does not know ({extra[0]}, ...): data added to a folder "
            f"would shift the epoch; put new data in a new folder, or delete the index for a new run"
        )
