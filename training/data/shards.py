"""Streaming data: a folder of shards in any store the product reads (a local folder, ``s3://``, the fsspec protocols
it supports), seen by training as one map-style dataset whose index is a global sample id.

    from training.data import ShardedDataset

    def train_dataset(self):
        return ShardedDataset("s3://corpus/tokens/", "tokens", block_size=1024)

Because every sample has one id (training/data/index.py), the product's data position applies unchanged: a run resumes
at the exact sample after any kill, and across global batch size and world size changes, with 0 repeats and 0
omissions. The epoch's order (``epoch_order``) needs no state to survive a resume: the shards are shuffled from (seed,
epoch), then the samples within each window of ``shuffle_window`` consecutive shards of that order; a position in it is
found by arithmetic, never by reading what came before (so a resume at 90 % of an epoch starts as fast as one at 10 %).

Formats (``format``):

- ``"tokens"``: token arrays as nanoGPT writes them, ``.bin`` (raw ``dtype``, uint16 by default) or ``.npy``; sample
  ``k`` of a shard is ``(x, y)`` = tokens ``[k*block_size, (k+1)*block_size)`` and the same shifted by one (int64).
  With ``vocab_size``, a token outside it is one DataError naming the shard (not an embedding's IndexError).
  Samples do not cross shards: the last ``< block_size + 1`` tokens of a shard are not trained on.
- ``"jsonl"``: one JSON value per non-empty line (a dict, usually); a line longer than ``max_sample_bytes`` stops the
  run with one line instead of reading 10 GB into memory.
- ``"parquet"``: one row per sample, a dict of column -> value (``columns`` picks some); needs pyarrow.
- ``"mds"`` (MosaicML Streaming) and ``"webdataset"`` (tars): other tools' formats, read in training/data/formats/.

Shards of a remote store are read whole into a local cache folder bounded by ``cache_bytes`` (least recently used
shards leave first), and memory-mapped from there; a local folder is read in place. Either way a shard's bytes are
checked against the fingerprint its index recorded (training/data/index.py) before a sample is read from it.

The store's options are ``storage_options``, else the worker's ``TRAIN_DATA_STORAGE_OPTIONS`` (JSON). In a deployment
run (and the processes it starts) the URL must lie under the worker's ``TRAIN_ALLOWED_ROOTS`` and only the worker's
options apply: both are checked before any I/O (training/config/trust.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from checkpointing.errors import TierUnavailable
from checkpointing.host_tier import private_dir
from checkpointing.io.confine import roots as confine_roots
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import parse_json
from training.config.text import parse_json as parse_json_text
from training.config.trust import DATA_OPTIONS_ENV, check_read_location, refuse_storage_options
from training.data.formats import OTHER_FORMATS
from training.data.index import INDEX_FILE, Shard, cache_folder, check_local, fetch, open_index
from training.exceptions import ConfigError, DataError

log = logging.getLogger(__name__)

FORMATS = ("tokens", "jsonl", "parquet", *OTHER_FORMATS)
EXTENSIONS = {"tokens": (".bin", ".npy"), "jsonl": (".jsonl",), "parquet": (".parquet",)}
EXTENSIONS.update({name: f.extensions for name, f in OTHER_FORMATS.items()})
TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
CACHE_ENV = "TRAIN_DATA_CACHE_DIR"
_MIX = 0x5AD_5EED  # keeps the data order's stream apart from any other seeded by the same (seed, epoch)
_OPEN_SHARDS = 8  # readers kept open per process (memory maps: page cache, not process memory)
_NPY_HEADER_MAX = 1 << 16


class ShardedDataset(Dataset):
    """A folder of ``format`` shards at ``url`` as one dataset indexed by global sample id (see the module's text)."""

    def __init__(
        self,
        url: str,
        format: str,
        *,
        block_size: int | None = None,
        dtype: str = "uint16",
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        shuffle_window: int = 4,
        cache_dir: str | None = None,
        cache_bytes: int = 4 << 30,
        max_sample_bytes: int = 16 << 20,
        vocab_size: int | None = None,
    ):
        if format not in FORMATS:
            raise ConfigError(f"format={format!r}: use one of {', '.join(FORMATS)}")
        if format == "tokens" and (type(block_size) is not int or block_size < 1):
            raise ConfigError(f"block_size={block_size!r}: token shards need a whole number of tokens >= 1 per sample")
        if format == "tokens" and dtype not in TOKEN_DTYPES:
            raise ConfigError(f"dtype={dtype!r}: use one of {', '.join(TOKEN_DTYPES)} (the .bin files' token type)")
        if type(shuffle_window) is not int or shuffle_window < 1:
            raise ConfigError(f"shuffle_window={shuffle_window!r}: use a whole number of shards >= 1")
        if type(cache_bytes) is not int or cache_bytes < 1 << 20:
            raise ConfigError(f"cache_bytes={cache_bytes!r}: use at least 1 MiB (1048576)")
        if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
            raise ConfigError(f"vocab_size={vocab_size!r}: use a whole number >= 1, or None to leave tokens unchecked")
        if type(max_sample_bytes) is not int or max_sample_bytes < 1:
            raise ConfigError(f"max_sample_bytes={max_sample_bytes!r}: use a whole number of bytes >= 1")
        self.storage_options = _options(url, storage_options)  # before any I/O: a confined run's checks
        self.url, self.format, self.block_size, self.dtype = url, format, block_size, dtype
        self.columns = list(columns) if columns is not None else None
        self.shuffle_window, self.cache_bytes, self.max_sample_bytes = shuffle_window, cache_bytes, max_sample_bytes
        self.vocab_size = vocab_size
        self.cache_dir = cache_dir or os.environ.get(CACHE_ENV) or _default_cache_dir()
        if format == "parquet":
            _pyarrow()  # at construction: a missing dependency is one line before any training
        self._storage: Storage | None = None
        self._readers: OrderedDict[int, _Reader] = OrderedDict()
        self._lock = threading.Lock()
        self._fetcher: ThreadPoolExecutor | None = None
        self._fetching: dict[int, Future[str]] = {}
        params: dict[str, Any] = {"block_size": block_size, "dtype": dtype} if format == "tokens" else {}
        self.meta = OTHER_FORMATS[format].prepare(self) if format in OTHER_FORMATS else None
        bound = _MAX_SAMPLES[format](self) if format in _MAX_SAMPLES else None
        other = OTHER_FORMATS.get(format)
        extensions = other.listed(self.meta) if other is not None and other.listed is not None else EXTENSIONS[format]
        self.index = open_index(self.storage, format, params, extensions, self._count, bound)

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"ShardedDataset({self.url!r}, {self.format!r}, {len(self.index.shards)} shards, {len(self)} samples)"

    # -- the dataset -------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, i: int) -> Any:
        j, k = self.index.locate(int(i))
        return self._reader(j).sample(k)

    def __getitems__(self, ids: list[int]) -> list[Any]:
        """A batch (what a DataLoader asks for): located at once, and read per shard in one go where the format
        can (token blocks are gathered with one fancy index), in the order asked."""
        out: list[Any] = [None] * len(ids)
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for n, i in enumerate(ids):
            j, k = self.index.locate(int(i))
            by_shard.setdefault(j, []).append((n, k))
        for j, wanted in by_shard.items():
            samples = self._reader(j).samples([k for _, k in wanted])
            for (n, _), sample in zip(wanted, samples, strict=True):
                out[n] = sample
        return out

    def epoch_order(self, seed: int, epoch: int, shuffle: bool = True) -> WindowedOrder:
        """The order in which epoch ``epoch`` visits the sample ids (ResumableBatchSampler uses it when the dataset
        has one): shards shuffled, then samples within windows of ``shuffle_window`` shards."""
        order = WindowedOrder([s.samples for s in self.index.shards], seed, epoch, self.shuffle_window, shuffle)
        order.on_window = self._prefetch
        return order

    def _prefetch(self, order: WindowedOrder, w: int) -> None:
        """The sampler reached window ``w`` of an epoch (it runs ahead of the loading by the loader's prefetch depth):
        that window's shards and the next window's are read into the cache on a background thread, so that loading
        finds them there. Only from a remote store, and only what fits in half the cache (the rest is being read)."""
        if self.storage.is_local:
            return
        shards = [int(j) for g in order.groups[w : w + 2] for j in g]
        budget, wanted = self.cache_bytes // 2, []
        for j in shards:
            budget -= self.index.shards[j].size
            if budget < 0:
                break
            wanted.append(j)
        with self._lock:
            if self._fetcher is None:
                self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")
            for j in wanted:
                if j not in self._fetching:
                    shard = self.index.shards[j]
                    self._fetching[j] = self._fetcher.submit(
                        _cache_fetch, self.storage, shard, self.cache_dir, self.cache_bytes
                    )

    # -- processes ---------------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a DataLoader worker receives: no open files, no client (each process makes its own)."""
        state = dict(self.__dict__)
        state.update(_storage=None, _readers=OrderedDict(), _lock=None, _fetcher=None, _fetching={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def storage(self) -> Storage:
        if self._storage is None:
            self._storage = Storage(self.url, self.storage_options)
        return self._storage

    # -- shards ------------------------------------------------------------------------------------------------------
    def _reader(self, j: int) -> _Reader:
        with self._lock:
            reader = self._readers.get(j)
            if reader is not None:
                self._readers.move_to_end(j)
                return reader
        shard = self.index.shards[j]
        reader = _READERS[self.format](self, shard, self._local(shard, j))
        with self._lock:
            self._readers[j] = reader
            # at most 8 open, and from a remote store no more mapped bytes than the cache may hold (an evicted shard
            # stays mapped, and resident, while a reader has it open)
            limit = None if self.storage.is_local else self.cache_bytes
            while len(self._readers) > 1 and (
                len(self._readers) > _OPEN_SHARDS
                or (limit is not None and sum(r.shard.size for r in self._readers.values()) > limit)
            ):
                self._readers.popitem(last=False)[1].close()
        return reader

    def _local(self, shard: Shard, j: int | None = None) -> IO[bytes]:
        """The shard as a local file: in place for a local folder, else a copy in the bounded cache."""
        storage = self.storage
        if storage.is_local:
            f = storage.open_read(shard.name)
            size = os.fstat(f.fileno()).st_size
            try:
                if size != shard.size:
                    raise _size_error(storage, shard, size)
                check_local(shard, f, storage.uri(shard.name), storage.uri(INDEX_FILE))  # its bytes, not only its size
            except BaseException:
                f.close()
                raise
            return f
        with self._lock:
            pending = self._fetching.pop(j, None) if j is not None else None
        path = None
        if pending is not None:
            with contextlib.suppress(Exception):  # a failed prefetch is read again here, where its error surfaces
                path = pending.result()
        if path is None or not os.path.exists(path):
            path = _cache_fetch(storage, shard, self.cache_dir, self.cache_bytes)
        return open(path, "rb")

    def _count(self, name: str, size: int) -> int:
        """A shard's samples, for an index being built."""
        shard = Shard(name, size, 0)
        if self.format in OTHER_FORMATS:
            return OTHER_FORMATS[self.format].count(self, name, size)
        if self.format == "tokens":
            tokens = _token_count(self.storage, shard, self.dtype)
            return max(0, (tokens - 1) // int(self.block_size))  # type: ignore[arg-type]
        if self.format == "parquet":
            with self.storage.open_read(name) as f:
                return int(_parquet_file(f, self.storage, name).metadata.num_rows)
        # read where it lies (not into the cache: the copy there is named by the fingerprint, taken after the count)
        with contextlib.closing(_JsonlReader(self, shard, self.storage.open_read(name), counting=True)) as reader:
            return reader.count


# -- readers -------------------------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, ds: ShardedDataset, shard: Shard, local: IO[bytes]):
        self.ds, self.shard, self.local = ds, shard, local

    def sample(self, k: int) -> Any:
        raise NotImplementedError

    def samples(self, ks: list[int]) -> list[Any]:
        return [self.sample(k) for k in ks]

    def close(self) -> None:
        self.local.close()

    def where(self) -> str:
        return self.ds.storage.uri(self.shard.name)


class _TokenReader(_Reader):
    def __init__(self, ds: ShardedDataset, shard: Shard, local: IO[bytes]):
        super().__init__(ds, shard, local)
        dtype, offset, count = _token_layout(local, shard.name, ds.dtype, shard.size, ds.storage)
        self.tokens = np.memmap(local, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count else None
        block = int(ds.block_size)  # type: ignore[arg-type]
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


class _JsonlReader(_Reader):
    def __init__(self, ds: ShardedDataset, shard: Shard, local: IO[bytes], counting: bool = False):
        super().__init__(ds, shard, local)
        self.starts, self.ends = _line_offsets(local, ds.max_sample_bytes, self.where)
        self.count = len(self.starts)
        if not counting and self.count != shard.samples:
            raise DataError(
                f"{self.where()}: {self.count} lines, the index says {shard.samples}: the shard changed; restore it, "
                f"or delete the index for a new run"
            )

    def sample(self, k: int) -> Any:
        f, start = self.local, int(self.starts[k])
        f.seek(start)
        data = f.read(int(self.ends[k]) - start)
        try:
            return parse_json(data, self.ds.max_sample_bytes, allow_nan=False)
        except Exception as exc:
            raise DataError(f"{self.where()}: line {k + 1} is not JSON this reader takes ({exc})") from None


class _ParquetReader(_Reader):
    """A Parquet shard, decoded whole on first use (samples within a window are visited in random order: reading a
    row group per sample would decode each row group once per row)."""

    def __init__(self, ds: ShardedDataset, shard: Shard, local: IO[bytes]):
        super().__init__(ds, shard, local)
        file = _parquet_file(local, ds.storage, shard.name)
        if file.metadata.num_rows != shard.samples:
            raise DataError(
                f"{self.where()}: {file.metadata.num_rows} rows, the index says {shard.samples}: the shard changed; "
                f"restore it, or delete the index for a new run"
            )
        try:
            self.table = file.read(columns=ds.columns)
        except Exception as exc:
            raise DataError(f"{self.where()}: its rows cannot be read ({type(exc).__name__})") from None

    def sample(self, k: int) -> dict[str, Any]:
        return self.table.slice(k, 1).to_pylist()[0]

    def samples(self, ks: list[int]) -> list[dict[str, Any]]:
        return self.table.take(ks).to_pylist()  # one gather for a batch's rows of this shard


_READERS: dict[str, Any] = {"tokens": _TokenReader, "jsonl": _JsonlReader, "parquet": _ParquetReader}
_READERS.update({name: f.reader for name, f in OTHER_FORMATS.items()})


def _token_layout(f: Any, name: str, dtype: str, size: int, storage: Storage) -> tuple[np.dtype, int, int]:
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


def _token_count(storage: Storage, shard: Shard, dtype: str) -> int:
    if not shard.name.endswith(".npy"):
        return _token_layout(None, shard.name, dtype, shard.size, storage)[2]
    with storage.open_read(shard.name) as f:
        return _token_layout(f, shard.name, dtype, shard.size, storage)[2]


def _line_offsets(f: Any, limit: int, where: Any) -> tuple[np.ndarray, np.ndarray]:
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


# -- where from ----------------------------------------------------------------------------------------------------
def _options(url: str, given: dict[str, Any] | None) -> dict[str, Any]:
    """The store's fsspec options: ``given``, else the worker's ``TRAIN_DATA_STORAGE_OPTIONS`` (JSON). In a confined
    run (a deployment run's processes) ``url`` must lie under the worker's roots and only the worker's options apply:
    options given by a recipe, which may have them from the run's parameters, are refused (training/config/trust.py)."""
    check_read_location(url, "ShardedDataset url")
    if given and confine_roots() is not None:
        refuse_storage_options(given, "ShardedDataset storage_options")
    if given:
        return dict(given)
    raw = os.environ.get(DATA_OPTIONS_ENV)
    options = parse_json_text(raw, DATA_OPTIONS_ENV) if raw else {}
    if not isinstance(options, dict):
        raise ConfigError(
            f"{DATA_OPTIONS_ENV}: give the data's storage options as a JSON object, not {type(options).__name__}"
        )
    return options


def _token_bound(ds: ShardedDataset) -> Callable[[int], int]:
    itemsize, block = np.dtype(ds.dtype).itemsize, int(ds.block_size)  # type: ignore[arg-type]
    return lambda size: max(0, (size // itemsize - 1) // block)


# The most samples a shard of ``size`` bytes can hold, per format (others: a byte a sample, training/data/index.py).
_MAX_SAMPLES: dict[str, Callable[[ShardedDataset], Callable[[int], int]]] = {
    "tokens": _token_bound,
    "jsonl": lambda ds: lambda size: (size + 1) // 2,  # a non-empty line and a newline between lines
}


# -- the cache -----------------------------------------------------------------------------------------------------
def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "resumable-train", "shards")


def _size_error(storage: Storage, shard: Shard, size: int) -> DataError:
    return DataError(
        f"{storage.uri(shard.name)} is {size} bytes, the index says {shard.size}: the shard changed or was cut short; "
        f"restore it, or delete the index for a new run"
    )


def _cache_fetch(storage: Storage, shard: Shard, root: str, max_bytes: int) -> str:
    """The shard's path in the cache, read into it whole if it is not there (at its indexed size)."""
    if shard.size > max_bytes:
        raise DataError(
            f"{storage.uri(shard.name)} is {shard.size} bytes, more than cache_bytes={max_bytes}; raise cache_bytes "
            f"above the largest shard"
        )
    folder = os.path.join(root, cache_folder(storage.url, shard))
    _own_folders(root, folder)
    target = os.path.join(folder, shard.name)
    if _cached(target, shard):
        return target
    # One download at a time into a cache folder, across this machine's processes (loader workers, ranks, the read-
    # ahead thread): room is made and filled under one lock, so the folder never holds more than cache_bytes.
    lock = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _cached(target, shard):  # another process read it in while this one waited
            return target
        _evict(root, shard.size, max_bytes)
        part = f"{target}.part-{os.getpid()}-{threading.get_ident()}"
        try:
            size = fetch(storage, shard, part, storage.uri(INDEX_FILE))  # its fingerprint checked on the way
            if size != shard.size:
                raise _size_error(storage, shard, size)
            os.replace(part, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
    finally:
        os.close(lock)
    return target


def _own_folders(root: str, folder: str) -> None:
    """The cache folder and the run's folder in it: real folders of this user that nobody else may enter (the host
    tier's check), so a folder another local user planted (under a shared /tmp, say) is never adopted: its files would
    be trained on as the shards."""
    os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
    parent = os.open(os.path.dirname(root) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        top = private_dir(parent, os.path.basename(root), root, CACHE_ENV)
    except TierUnavailable as exc:
        raise DataError(f"shard cache: {exc}") from None
    finally:
        os.close(parent)
    try:
        os.close(private_dir(top, os.path.basename(folder), folder, CACHE_ENV))
    except TierUnavailable as exc:
        raise DataError(f"shard cache: {exc}") from None
    finally:
        os.close(top)


def _cached(target: str, shard: Shard) -> bool:
    """The shard is in the cache whole (at its indexed size); marked most recently used."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != shard.size:
        return False
    os.utime(target)
    return True


def _evict(root: str, need: int, limit: int) -> None:
    """Removes the least recently used shards of the cache (every dataset's) until ``need`` more bytes fit in
    ``limit``. A shard being read into the cache by another process (``.part-``) is counted, never removed."""
    files = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total + need <= limit:
            break
        if ".part-" in os.path.basename(path) or os.path.basename(path) == ".lock":
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a reader that has it mapped keeps its pages
        total -= size


# -- the order -----------------------------------------------------------------------------------------------------
class WindowedOrder:
    """An epoch's sample order, computed a window at a time: ``order[a:b]`` and ``order[i]`` cost the windows they
    touch, never the epoch before them. Shards are permuted from (seed, epoch); each window of ``window`` consecutive
    shards of that permutation has its samples permuted from (seed, epoch, window number)."""

    def __init__(self, counts: Sequence[int], seed: int, epoch: int, window: int, shuffle: bool = True):
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        n = len(counts)
        starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        perm = self._rng(-1).permutation(n) if shuffle else np.arange(n)
        self.groups = [perm[w : w + window] for w in range(0, n, window)]
        self.starts, self.counts = starts, np.asarray(counts, dtype=np.int64)
        sizes = [int(self.counts[g].sum()) for g in self.groups]
        self.window_starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.on_window: Callable[[WindowedOrder, int], None] | None = None  # told when a window is first computed

    def _rng(self, window: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([_MIX, self.seed & (2**63 - 1), self.epoch, window + 1]))

    def __len__(self) -> int:
        return int(self.window_starts[-1])

    def window(self, w: int) -> np.ndarray:
        ids = self._cache.get(w)
        if ids is None:
            parts = [np.arange(self.starts[s], self.starts[s] + self.counts[s]) for s in self.groups[w]]
            ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
            if self.shuffle:
                ids = ids[self._rng(w).permutation(len(ids))]
            self._cache[w] = ids
            if self.on_window is not None:
                self.on_window(self, w)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return ids

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("an epoch order is sliced in order only")
            parts = []
            while start < stop:
                w = int(np.searchsorted(self.window_starts, start, side="right")) - 1
                begin, end = int(self.window_starts[w]), int(self.window_starts[w + 1])
                parts.append(self.window(w)[start - begin : min(stop, end) - begin])
                start = min(stop, end)
            return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, np.int64))
        i = int(key) + (len(self) if key < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(key)
        w = int(np.searchsorted(self.window_starts, i, side="right")) - 1
        return torch.tensor(int(self.window(w)[i - int(self.window_starts[w])]))
