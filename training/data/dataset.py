"""Streaming data: a folder of shards in any store the product reads (a local folder, ``s3://``, the fsspec protocols
it supports), seen by training as one map-style dataset whose index is a global sample id.

    from training.data import ShardedDataset

    def train_dataset(self):
        return ShardedDataset("s3://corpus/tokens/", "tokens", block_size=1024)

Because every sample has one id (training/data/index.py), the product's data position applies unchanged: a run resumes
at the exact sample after any kill, and across global batch size and world size changes, with 0 repeats and 0
omissions. The epoch's order (``epoch_order``, training/data/order.py) needs no state to survive a resume.

Formats (``format``), one module each in training/data/formats/: ``"tokens"`` (nanoGPT's ``.bin``/``.npy`` token
arrays, ``block_size`` tokens a sample), ``"jsonl"`` (one JSON value a line), ``"parquet"`` (a row a sample; needs
pyarrow), ``"mds"`` (MosaicML Streaming) and ``"webdataset"`` (tars).

Shards of a remote store are read whole into a local cache folder bounded by ``cache_bytes`` and memory-mapped from
there; a local folder is read in place; either way checked against the index's fingerprint (training/data/cache.py).
This module holds what ties them together: the arguments, the index, the readers kept open, the read-ahead.

The store's options are ``storage_options``, else the worker's ``TRAIN_DATA_STORAGE_OPTIONS`` (JSON). In a deployment
run (and the processes it starts) the URL must lie under the worker's ``TRAIN_ALLOWED_ROOTS`` and only the worker's
options apply: both are checked before any I/O (training/config/trust.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from torch.utils.data import Dataset

from checkpointing.io.confine import roots as confine_roots
from checkpointing.io.storage import Storage
from training.config.text import parse_json as parse_json_text
from training.config.trust import DATA_OPTIONS_ENV, check_read_location, refuse_storage_options
from training.data.cache import CACHE_ENV, cached_copy, default_cache_dir, open_in_place
from training.data.formats import SHARD_FORMATS, ShardFormat
from training.data.formats.base import ShardReader
from training.data.index import Shard, open_index
from training.data.order import WindowedOrder
from training.exceptions import ConfigError

log = logging.getLogger(__name__)

FORMATS = tuple(SHARD_FORMATS)
_OPEN_SHARDS = 8  # readers kept open per process (memory maps: page cache, not process memory)


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
        if format not in SHARD_FORMATS:
            raise ConfigError(f"format={format!r}: use one of {', '.join(FORMATS)}")
        self.url, self.format, self.block_size, self.dtype = url, format, block_size, dtype
        self.columns = list(columns) if columns is not None else None
        self.shuffle_window, self.cache_bytes, self.max_sample_bytes = shuffle_window, cache_bytes, max_sample_bytes
        self.vocab_size = vocab_size
        self._check_arguments()
        self.storage_options = _options(url, storage_options)  # before any I/O: a confined run's checks
        self.cache_dir = cache_dir or os.environ.get(CACHE_ENV) or default_cache_dir()
        self._storage: Storage | None = None
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._lock = threading.Lock()
        self._fetcher: ThreadPoolExecutor | None = None
        self._fetching: dict[int, Future[str]] = {}
        fmt = self.shard_format
        self.meta = fmt.prepare(self)
        bound = fmt.max_samples(self) if fmt.max_samples is not None else None
        extensions = fmt.listed(self.meta) if fmt.listed is not None else fmt.extensions
        self.index = open_index(self.storage, format, fmt.params(self), extensions, self._count, bound)

    def _check_arguments(self) -> None:
        """One ConfigError naming the first bad argument, before any I/O: the format's own first."""
        self.shard_format.check(self)
        if type(self.shuffle_window) is not int or self.shuffle_window < 1:
            raise ConfigError(f"shuffle_window={self.shuffle_window!r}: use a whole number of shards >= 1")
        if type(self.cache_bytes) is not int or self.cache_bytes < 1 << 20:
            raise ConfigError(f"cache_bytes={self.cache_bytes!r}: use at least 1 MiB (1048576)")
        vocab = self.vocab_size
        if vocab is not None and (type(vocab) is not int or vocab < 1):
            raise ConfigError(f"vocab_size={vocab!r}: use a whole number >= 1, or None to leave tokens unchecked")
        if type(self.max_sample_bytes) is not int or self.max_sample_bytes < 1:
            raise ConfigError(f"max_sample_bytes={self.max_sample_bytes!r}: use a whole number of bytes >= 1")

    @property
    def shard_format(self) -> ShardFormat:
        return SHARD_FORMATS[self.format]

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
                        cached_copy, self.storage, shard, self.cache_dir, self.cache_bytes
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
    def _reader(self, j: int) -> ShardReader:
        with self._lock:
            reader = self._readers.get(j)
            if reader is not None:
                self._readers.move_to_end(j)
                return reader
        shard = self.index.shards[j]
        reader = self.shard_format.reader(self, shard, self._local(shard, j))
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
        """The shard as a local file: in place for a local folder, else a copy in the bounded cache (the one the
        read-ahead fetched, where it did)."""
        if self.storage.is_local:
            return open_in_place(self.storage, shard)
        with self._lock:
            pending = self._fetching.pop(j, None) if j is not None else None
        path = None
        if pending is not None:
            with contextlib.suppress(Exception):  # a failed prefetch is read again here, where its error surfaces
                path = pending.result()
        if path is None or not os.path.exists(path):
            path = cached_copy(self.storage, shard, self.cache_dir, self.cache_bytes)
        return open(path, "rb")

    def _count(self, name: str, size: int) -> int:
        """A shard's samples, for an index being built."""
        return self.shard_format.count(self, name, size)


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
