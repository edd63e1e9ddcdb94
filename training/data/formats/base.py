"""What a shard format gives ``ShardedDataset`` (training/data/dataset.py), and the one reader shape every format's
readers share: built from the dataset, the shard's index entry ``Shard`` and the shard as a local file; ``sample(k)``.
Kept apart so that the formats and the dataset depend on it, and never on each other."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from training.data.index import Shard
from training.exceptions import DataError


class ShardReader:
    """One shard, read by sample number. ``ds`` is the ShardedDataset (its storage, options and format ``meta``)."""

    def __init__(self, ds: Any, shard: Shard, local: IO[bytes]):
        self.ds, self.shard, self.local = ds, shard, local

    def sample(self, k: int) -> Any:
        raise NotImplementedError

    def samples(self, ks: list[int]) -> list[Any]:
        return [self.sample(k) for k in ks]

    def close(self) -> None:
        self.local.close()

    def where(self) -> str:
        return str(self.ds.storage.uri(self.shard.name))

    def damaged(self, what: str) -> DataError:
        """The one error of a damaged shard: names it, says what is wrong and what to do."""
        return DataError(f"{self.where()}: {what}; restore the shard as its writer wrote it")

    def check_count(self, found: int, unit: str) -> None:
        if found != self.shard.samples:
            raise DataError(
                f"{self.where()}: {found} {unit}, the index says {self.shard.samples}: the shard changed; restore it, "
                f"or delete the index for a new run"
            )


def _nothing(ds: Any) -> None:
    return None


def _no_params(ds: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ShardFormat:
    extensions: tuple[str, ...]
    count: Callable[[Any, str, int], int]  # (dataset, shard name, bytes) -> samples, for an index being built
    reader: type[ShardReader]
    # (dataset) -> what every shard's reader needs, read once (kept as ``ds.meta``); a missing dependency fails here
    prepare: Callable[[Any], Any] = _nothing
    # (what ``prepare`` returned) -> the endings of this dataset's shards, where they narrow ``extensions``
    listed: Callable[[Any], tuple[str, ...]] | None = None
    # (dataset) -> None: the format's own arguments checked, before any I/O (one ConfigError naming the bad one)
    check: Callable[[Any], None] = _nothing
    # (dataset) -> the arguments the index records: a folder indexed with others is refused, not misread
    params: Callable[[Any], dict[str, Any]] = _no_params
    # (dataset) -> (bytes -> the most samples a shard of that size holds); None: a byte a sample (training/data/index.py)
    max_samples: Callable[[Any], Callable[[int], int]] | None = None


def decode_image(data: bytes) -> Any:
    """An image member or column: a PIL image when Pillow is installed, else its bytes (ValueError if PIL refuses)."""
    try:
        from PIL import Image
    except ImportError:
        return data
    try:
        return Image.open(io.BytesIO(data))
    except Exception as exc:
        raise ValueError(type(exc).__name__) from None
