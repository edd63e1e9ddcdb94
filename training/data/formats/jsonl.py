"""JSON Lines shards (``format="jsonl"``): one JSON value per non-empty line, a dict usually. A shard's lines are found
by one chunked scan for newlines (the offsets kept, the text not), so a sample is one seek and one bounded parse; a line
longer than ``max_sample_bytes`` stops the run with one line instead of reading 10 GB into memory."""

from __future__ import annotations

import contextlib
from typing import IO, Any

import numpy as np

from checkpointing.io.untrusted import parse_json
from training.data.formats.base import ShardFormat, ShardReader
from training.data.index import Shard
from training.exceptions import DataError


def line_offsets(f: Any, limit: int, where: Any) -> tuple[np.ndarray, np.ndarray]:
    """Start and end byte of every non-empty line, read in chunks: a line longer than ``limit`` stops it early."""
    starts, ends, base, line_start, number = [], [], 0, 0, 0
    f.seek(0)
    while chunk := f.read(8 << 20):
        arr = np.frombuffer(chunk, dtype=np.uint8)
        newlines = np.flatnonzero(arr == 10) + base
        begins = np.concatenate(([line_start], newlines[:-1] + 1)) if len(newlines) else np.empty(0, np.int64)
        if len(newlines):
            lengths = newlines - begins
            if (lengths > limit).any():
                bad = int(np.flatnonzero(lengths > limit)[0])
                raise DataError(
                    f"{where()}: line {number + bad + 1} is longer than max_sample_bytes={limit}; raise it, or split "
                    f"the line"
                )
            keep = lengths > 0
            starts.append(begins[keep])
            ends.append(newlines[keep])
            number += len(newlines)
            line_start = int(newlines[-1]) + 1
        base += len(chunk)
        if base - line_start > limit:
            raise DataError(
                f"{where()}: line {number + 1} is longer than max_sample_bytes={limit}; raise it, or split the line"
            )
    if base > line_start:  # a last line without a newline
        starts.append(np.array([line_start]))
        ends.append(np.array([base]))
    cat = np.concatenate
    return (cat(starts) if starts else np.empty(0, np.int64)), (cat(ends) if ends else np.empty(0, np.int64))


class JsonlReader(ShardReader):
    def __init__(self, ds: Any, shard: Shard, local: IO[bytes], counting: bool = False):
        super().__init__(ds, shard, local)
        self.starts, self.ends = line_offsets(local, ds.max_sample_bytes, self.where)
        self.count = len(self.starts)
        if not counting:
            self.check_count(self.count, "lines")

    def sample(self, k: int) -> Any:
        f, start = self.local, int(self.starts[k])
        f.seek(start)
        data = f.read(int(self.ends[k]) - start)
        try:
            return parse_json(data, self.ds.max_sample_bytes, allow_nan=False)
        except Exception as exc:
            raise DataError(f"{self.where()}: line {k + 1} is not JSON this reader takes ({exc})") from None


def count(ds: Any, name: str, size: int) -> int:
    """The shard's lines, for an index being built: read where it lies (not into the cache: the copy there is named by
    the fingerprint, taken after the count)."""
    shard = Shard(name, size, 0)
    with contextlib.closing(JsonlReader(ds, shard, ds.storage.open_read(name), counting=True)) as reader:
        return reader.count


JSONL = ShardFormat(
    extensions=(".jsonl",),
    count=count,
    reader=JsonlReader,
    max_samples=lambda ds: lambda size: (size + 1) // 2,  # a non-empty line and a newline between lines
)
