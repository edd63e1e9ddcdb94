"""What a shard format of another tool gives ``ShardedDataset``, and the reader's shape (the same as shards.py's own
readers: built from the dataset, its index entry ``Shard`` and the shard as a local file; ``sample(k)``)."""

from __future__ import annotations

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


@dataclass(frozen=True)
class ShardFormat:
    extensions: tuple[str, ...]
    prepare: Callable[[Any], Any]  # (dataset) -> what every shard's reader needs, read once (kept as ``ds.meta``)
    count: Callable[[Any, str, int], int]  # (dataset, shard name, bytes) -> samples, for an index being built
    reader: type[ShardReader]
    # (what ``prepare`` returned) -> the endings of this dataset's shards, where they narrow ``extensions``
    listed: Callable[[Any], tuple[str, ...]] | None = None
