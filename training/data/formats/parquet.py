"""Parquet shards (``format="parquet"``): one row per sample, a dict of column -> value (``columns`` picks some). Needs
pyarrow (the ``data`` extra), checked when the dataset is made so that its absence is one line before any training."""

from __future__ import annotations

from typing import IO, Any

from checkpointing.io.storage import Storage
from training.data.formats.base import ShardFormat, ShardReader
from training.data.index import Shard
from training.exceptions import ConfigError, DataError


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "format='parquet' needs pyarrow: pip install 'resumable-train[data]' (or pyarrow) where the run trains"
        ) from None
    return pq


def _parquet_file(f: Any, storage: Storage, name: str) -> Any:
    pq = _pyarrow()
    try:
        return pq.ParquetFile(f)
    except Exception as exc:
        raise DataError(f"{storage.uri(name)}: not a Parquet file pyarrow reads ({type(exc).__name__})") from None


def prepare(ds: Any) -> None:
    _pyarrow()  # at construction: a missing dependency is one line before any training


def count(ds: Any, name: str, size: int) -> int:
    """The shard's rows from its footer, for an index being built."""
    with ds.storage.open_read(name) as f:
        return int(_parquet_file(f, ds.storage, name).metadata.num_rows)


class ParquetReader(ShardReader):
    """A Parquet shard, decoded whole on first use (samples within a window are visited in random order: reading a
    row group per sample would decode each row group once per row)."""

    def __init__(self, ds: Any, shard: Shard, local: IO[bytes]):
        super().__init__(ds, shard, local)
        file = _parquet_file(local, ds.storage, shard.name)
        self.check_count(file.metadata.num_rows, "rows")
        try:
            self.table = file.read(columns=ds.columns)
        except Exception as exc:
            raise DataError(f"{self.where()}: its rows cannot be read ({type(exc).__name__})") from None

    def sample(self, k: int) -> dict[str, Any]:
        return self.table.slice(k, 1).to_pylist()[0]

    def samples(self, ks: list[int]) -> list[dict[str, Any]]:
        return self.table.take(ks).to_pylist()  # one gather for a batch's rows of this shard


PARQUET = ShardFormat(extensions=(".parquet",), count=count, reader=ParquetReader, prepare=prepare)
