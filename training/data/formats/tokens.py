"""Token shards as nanoGPT writes them (``format="tokens"``): ``.bin`` (raw ``dtype``, uint16 by default) or ``.npy``.
Sample ``k`` of a shard is ``(x, y)`` = tokens ``[k*block_size, (k+1)*block_size)`` and the same shifted by one (int64),
so a shard's samples are arithmetic on its length and a batch is one gather from a memory map. With ``vocab_size``, a
token outside it is one DataError naming the shard (not an embedding's IndexError). Samples do not cross shards: the
last ``< block_size + 1`` tokens of a shard are not trained on."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import torch

from checkpointing.io.storage import Storage
from training.data.formats.base import ShardFormat, ShardReader
from training.data.index import Shard
from training.exceptions import ConfigError, DataError

TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
_NPY_HEADER_MAX = 1 << 16


def check(ds: Any) -> None:
    if type(ds.block_size) is not int or ds.block_size < 1:
        raise ConfigError(f"block_size={ds.block_size!r}: token shards need a whole number of tokens >= 1 per sample")
    if ds.dtype not in TOKEN_DTYPES:
        raise ConfigError(f"dtype={ds.dtype!r}: use one of {', '.join(TOKEN_DTYPES)} (the .bin files' token type)")


def layout(f: Any, name: str, dtype: str, size: int, storage: Storage) -> tuple[np.dtype, int, int]:
    """(dtype, byte offset of token 0, tokens) of a token shard: ``.npy`` says in its header, ``.bin`` is raw."""
    if not name.endswith(".npy"):
        dt = np.dtype(dtype)
        if size % dt.itemsize:
            raise DataError(f"{storage.uri(name)}: {size} bytes is not a whole number of {dtype} tokens")
        return dt, 0, size // dt.itemsize
    f.seek(0)
    head = f.read(_NPY_HEADER_MAX)
    try:
        buffer = io.BytesIO(head)
        version = np.lib.format.read_magic(buffer)
        fmt = np.lib.format
        read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}[version]
        shape, _, dt = read(buffer, max_header_size=_NPY_HEADER_MAX)
    except Exception as exc:
        raise DataError(f"{storage.uri(name)}: not a .npy file numpy reads ({type(exc).__name__})") from None
    if len(shape) != 1 or dt.kind not in "iu" or dt.hasobject:
        raise DataError(f"{storage.uri(name)}: a .npy token shard must be one dimension of integers, not {dt} {shape}")
    offset = buffer.tell()
    if offset + shape[0] * dt.itemsize > size:
        raise DataError(
            f"{storage.uri(name)}: its header says {shape[0]} tokens, the file holds fewer; restore the shard"
        )
    return dt, offset, int(shape[0])


def count(ds: Any, name: str, size: int) -> int:
    """The shard's samples, for an index being built (a ``.npy`` header read where it lies)."""
    if not name.endswith(".npy"):
        tokens = layout(None, name, ds.dtype, size, ds.storage)[2]
    else:
        with ds.storage.open_read(name) as f:
            tokens = layout(f, name, ds.dtype, size, ds.storage)[2]
    return max(0, (tokens - 1) // int(ds.block_size))


def max_samples(ds: Any) -> Callable[[int], int]:
    itemsize, block = np.dtype(ds.dtype).itemsize, int(ds.block_size)
    return lambda size: max(0, (size // itemsize - 1) // block)


class TokenReader(ShardReader):
    def __init__(self, ds: Any, shard: Shard, local: IO[bytes]):
        super().__init__(ds, shard, local)
        dtype, offset, count = layout(local, shard.name, ds.dtype, shard.size, ds.storage)
        self.tokens = np.memmap(local, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count else None
        block = int(ds.block_size)
        if max(0, (count - 1) // block) != shard.samples:
            raise DataError(
                f"{self.where()}: {count} tokens hold {max(0, (count - 1) // block)} samples of {block}, the index "
                f"says {shard.samples}: the shard changed; restore it, or delete the index for a new run"
            )
        self.block = block

    def sample(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tokens is not None
        block = self.tokens[k * self.block : (k + 1) * self.block + 1]
        vocab = self.ds.vocab_size
        if vocab is not None and int(block.max()) >= vocab:  # an embedding would fail with an IndexError, retried
            raise DataError(
                f"{self.where()}: sample {k} holds token {int(block.max())}, outside vocab_size={vocab}; tokenize with "
                f"that vocabulary, or set the model's vocab_size above the largest token"
            )
        chunk = torch.from_numpy(block.astype(np.int64))
        return chunk[:-1], chunk[1:]

    def samples(self, ks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.tokens is not None
        starts = np.asarray(ks, dtype=np.int64)[:, None] * self.block
        blocks = self.tokens[starts + np.arange(self.block + 1)]  # (n, block + 1), one gather
        vocab = self.ds.vocab_size
        if vocab is not None and len(ks) and int(blocks.max()) >= vocab:
            return [self.sample(k) for k in ks]  # the sample at fault names itself
        chunks = torch.from_numpy(blocks.astype(np.int64))
        return [(c[:-1], c[1:]) for c in chunks]

    def close(self) -> None:
        self.tokens = None
        super().close()


TOKENS = ShardFormat(
    extensions=(".bin", ".npy"),
    count=count,
    reader=TokenReader,
    check=check,
    params=lambda ds: {"block_size": ds.block_size, "dtype": ds.dtype},
    max_samples=max_samples,
)
