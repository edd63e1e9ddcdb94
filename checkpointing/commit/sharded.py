"""Sharded checkpoints: torch.distributed.checkpoint (DCP) under our manifest → ``latest`` commit protocol.

DCP lets every rank write its own shards in parallel and load them back at any world size. It commits by
writing ``.metadata`` last and trusts what it reads; we keep our protocol instead: each rank streams its
files through a hashing writer, rank 0 gathers every rank's (file, size, sha256) after DCP finishes, and
commits them with ``CheckpointStore.commit_files`` (manifest, then ``latest``, fenced). So ``check``,
``verify``, fallback and retention treat a sharded checkpoint as a checkpoint with more files.

On load nothing is deserialized unless the manifest vouches for its bytes. DCP reads ``.metadata`` with
plain ``pickle`` and non-tensor values with ``torch.load(weights_only=False)``: here ``.metadata`` is
hashed against the manifest and then unpickled by an allow-list of DCP's own classes (dcp_metadata.py),
non-tensor values load with ``weights_only=True``, every item's zip is bounded by its own size before it is
torch.loaded (serialization.py), and each shard file a rank's plan touches is read whole once, hashed and
compared before DCP sees a byte of it. A rank reads only the files its plan needs: DCP's files are split
so that small items (optimizer hyper-parameters, step counters) sit apart from the big tensor shards.

Works with an initialized process group (every rank calls the same function; ``ranks.py`` makes them
agree on failures) or without one (one process). No Prefect import.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import queue
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from checkpointing import ranks
from checkpointing.commit.dcp_metadata import load_metadata
from checkpointing.commit.streaming import HashingWriter, open_for_write, write_object
from checkpointing.errors import CheckpointError, CorruptCheckpointError
from checkpointing.manifest import FileEntry, Writer
from checkpointing.serialization import check_unpacked_size
from checkpointing.store import (
    CHECKPOINTS,
    SHARDED_FORMAT,
    CheckpointInfo,
    CheckpointStore,
    read_vouched,
    safe_load,
    validate_file_name,
)

log = logging.getLogger(__name__)

FORMAT = SHARDED_FORMAT  # manifest.metadata["format"] of a sharded checkpoint
DCP_METADATA = ".metadata"
_SMALL_ITEM = 256 * 1024  # items under this go to a rank's small file, which other ranks may need whole


def is_sharded(info: CheckpointInfo) -> bool:
    return info.sharded


# -- save -----------------------------------------------------------------------------------------
def save_state(
    store: CheckpointStore,
    name: str,
    state_dict: dict[str, Any],
    *,
    files: dict[str, Any] | None = None,
    progress: dict[str, int],
    metadata: dict[str, Any] | None = None,
    writer: Writer | None = None,
) -> CheckpointInfo:
    """Saves ``state_dict`` (DTensors, tensors, plain values) as DCP shards, plus this rank's ``files``
    (file name -> object, ``torch.save``'d), and commits them all. Every rank calls it; every rank gets
    the committed checkpoint or the same error. ``progress``/``metadata``/``writer``: rank 0's count."""
    ranks.on_every_rank(lambda: [validate_file_name(f) for f in files or {}])  # names become paths: before writing
    writer = writer or Writer.current()
    ranks.on_rank0(lambda: store.begin_commit(name, writer))
    prefix = f"{CHECKPOINTS}/{name}"
    entries = ranks.on_every_rank(
        lambda: {f: write_object(store.storage, f"{prefix}/{f}", o) for f, o in (files or {}).items()}
    )
    storage_writer = _HashingWriter(store, name)
    with _unwrapped(), _single_process_quiet():
        dcp.save(state_dict, storage_writer=storage_writer, no_dist=ranks.group() is None)
    entries.update(storage_writer.entries)
    everyone = ranks.gather_to_rank0(entries)
    meta = {**(metadata or {}), "format": FORMAT, "world_size": (ranks.group() or (0, 1))[1]}
    return ranks.on_rank0(
        lambda: store.commit_files(name, _merged(everyone), progress=progress, metadata=meta, writer=writer)
    )


class _HashingFileSystem(FileSystem):
    """DCP's fsspec file system, on the store's own fsspec instance, hashing every file it writes."""

    def __init__(self, store: CheckpointStore, name: str):
        super().__init__()
        self.storage, self.prefix = store.storage, f"{CHECKPOINTS}/{name}"
        self.fs = self.storage.fs
        self.entries: dict[str, FileEntry] = {}
        self.size_hints: dict[str, int] = {}  # file name -> planned bytes, for the object store's part size

    def key(self, path: str | os.PathLike) -> str:
        folder, fname = os.path.split(os.fspath(path))
        if folder != self.storage.path(self.prefix):
            raise CheckpointError(f"DCP asked for {path}, outside {self.storage.uri(self.prefix)}")
        return f"{self.prefix}/{fname}"

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            raise CheckpointError(f"{path}: a sharded save only writes")
        key = self.key(path)
        try:
            with open_for_write(self.storage, key, self.size_hints.get(key.rsplit("/", 1)[1])) as raw:
                stream = HashingWriter(raw)
                yield stream
        except BaseException:
            with contextlib.suppress(Exception):  # best effort; the next save of this name clears the folder
                self.storage.delete(key)
            raise
        self.entries[key.rsplit("/", 1)[1]] = stream.entry()

    def mkdir(self, path) -> None:
        """The checkpoint's folder; locally made through no link (fsspec's makedirs follows them)."""
        if self.storage.local is None:
            return super().mkdir(path)
        if os.fspath(path) != self.storage.path(self.prefix):
            raise CheckpointError(f"DCP asked for the folder {path}, not {self.storage.uri(self.prefix)}")
        self.storage.local.make_folder(self.prefix)

    def rename(self, path, new_path) -> None:
        """DCP writes ``.metadata.tmp`` and renames it: a local rename, a copy on object stores (no rename)."""
        old, new = self.key(path), self.key(new_path)
        if self.storage.local is not None:
            self.storage.local.rename(old, new)  # in the folder reached through no link; replaces a link there
        else:
            self.storage.fs.mv(self.storage.path(old), self.storage.path(new))
        self.entries[new.rsplit("/", 1)[1]] = self.entries.pop(old.rsplit("/", 1)[1])


class _HashingWriter(FsspecWriter):
    """DCP's fsspec writer, writing through ``_HashingFileSystem`` and keeping small items in a file apart."""

    def __init__(self, store: CheckpointStore, name: str):
        folder = store.storage.path(f"{CHECKPOINTS}/{name}")
        super().__init__(folder, sync_files=store.storage.is_local)  # fsync has no meaning on object stores
        self.hashing = _HashingFileSystem(store, name)
        self.fs = self.hashing  # type: ignore[assignment]  # (the base class declares torch's local FileSystem)
        self.path = folder

    @property
    def entries(self) -> dict[str, FileEntry]:
        return self.hashing.entries

    def write_data(self, plan, planner):
        """DCP's one file per rank, split in two: big tensor shards, and the small items (hyper-parameters,
        step counters, biases) that a rank of another world size may need without the big ones."""
        small = [i for i in plan.items if _item_bytes(i) < _SMALL_ITEM]
        large = [i for i in plan.items if _item_bytes(i) >= _SMALL_ITEM]
        files: queue.Queue = queue.Queue()
        for part, items in (("0", large), ("small", small)):
            if items:
                fname = f"{plan.storage_data.prefix}{part}{DEFAULT_SUFFIX}"
                self.hashing.size_hints[fname] = sum(_item_bytes(i) for i in items) + 1024 * 1024
                files.put((self.fs.concat_path(self.path, fname), fname, items))
        return self._write_data(planner, files)


def _item_bytes(item) -> int:
    if item.tensor_data is None:  # a pickled value: small, size unknown until written
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


# -- load -----------------------------------------------------------------------------------------
def load_state(store: CheckpointStore, info: CheckpointInfo, state_dict: dict[str, Any]) -> list[str]:
    """Loads a sharded checkpoint into ``state_dict`` in place (resharding to this world size); returns the
    files this rank read. Every rank calls it; every rank gets CorruptCheckpointError if any rank's files
    fail their check (so all fall back together)."""
    if not is_sharded(info):
        raise CheckpointError(f"{info.uri}: not a sharded ({FORMAT}) checkpoint")
    metadata = ranks.on_every_rank(lambda: read_dcp_metadata(store, info))
    reader = _VouchedReader(store, info, metadata)
    with _unwrapped(), _single_process_quiet():
        dcp.load(state_dict, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=ranks.group() is None)
    return [DCP_METADATA, *reader.vouched.files_read]


def read_dcp_metadata(store: CheckpointStore, info: CheckpointInfo) -> dcp_metadata.Metadata:
    """DCP's ``.metadata``, hashed against the manifest before it is unpickled, and unpickled by an
    allow-list of DCP's own classes (``pickle`` itself would run whatever the file asks)."""
    entry = info.manifest.files.get(DCP_METADATA)
    if entry is None:
        raise CorruptCheckpointError(f"{info.uri}: the manifest lists no {DCP_METADATA}")
    data = read_vouched(store.storage, f"{CHECKPOINTS}/{info.name}/{DCP_METADATA}", entry)
    return load_metadata(data, f"{info.uri}/{DCP_METADATA}")


def load_files(store: CheckpointStore, info: CheckpointInfo, names: Iterable[str]) -> dict[str, Any]:
    """The small ``torch.save``'d files of a checkpoint (of ``names``, those it has), verified and loaded
    with ``weights_only=True``. Every rank calls it (with its own names); all fail if one does."""

    def read() -> dict[str, Any]:
        out = {}
        for fname in names:
            entry = info.manifest.files.get(fname)
            if entry is not None:
                data = read_vouched(store.storage, f"{CHECKPOINTS}/{info.name}/{fname}", entry)
                out[fname] = safe_load(data, f"{info.uri}/{fname}")
        return out

    return ranks.on_every_rank(read)


class _VouchedFileSystem(FileSystem):
    """Serves DCP each file it opens from one verified read: whole, hashed, compared with the manifest."""

    def __init__(self, store: CheckpointStore, info: CheckpointInfo):
        super().__init__()
        self.store, self.info = store, info
        self.fs = store.storage.fs
        self.files_read: list[str] = []

    @contextmanager
    def create_stream(self, path, mode):
        fname = os.path.basename(os.fspath(path))
        entry = self.info.manifest.files.get(fname)
        if "r" not in mode or entry is None:
            raise CorruptCheckpointError(f"{self.info.uri}/{fname}: DCP asked for a file the manifest does not list")
        data = read_vouched(self.store.storage, f"{CHECKPOINTS}/{self.info.name}/{fname}", entry)
        self.files_read.append(fname)
        yield io.BytesIO(data)


class _VouchedReader(FsspecReader):
    def __init__(self, store: CheckpointStore, info: CheckpointInfo, metadata: dcp_metadata.Metadata):
        folder = store.storage.path(f"{CHECKPOINTS}/{info.name}")
        super().__init__(folder)
        self.vouched = _VouchedFileSystem(store, info)
        self.fs = self.vouched  # type: ignore[assignment]  # (the base class declares torch's local FileSystem)
        self.path = folder
        self._metadata = metadata

    def _slice_file(self, file, sinfo: _StorageInfo):
        """One item of a shard file. DCP torch.loads a tensor item itself: its zip is bounded here first."""
        where = f"{self.vouched.info.uri}/{sinfo.relative_path} (item at byte {sinfo.offset})"
        with file.getbuffer() as whole:  # the vouched file, held whole (_VouchedFileSystem)
            if sinfo.offset + sinfo.length > len(whole):
                raise CorruptCheckpointError(f"{where}: {DCP_METADATA} places an item past the end of the file")
            check_unpacked_size(whole[sinfo.offset : sinfo.offset + sinfo.length], where)
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The metadata read (and vouched for) before DCP started; DCP's own read would unpickle freely."""
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        """Before any read: every file DCP's metadata points at must be one the manifest lists."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        listed = self.vouched.info.manifest.files
        unlisted = {
            getattr(i, "relative_path", repr(i))
            for i in self.storage_data.values()
            if not isinstance(i, _StorageInfo) or i.relative_path not in listed
        }
        if unlisted:
            raise CorruptCheckpointError(
                f"{self.vouched.info.uri}/{DCP_METADATA} points at files the manifest does not list: {sorted(unlisted)}"
            )


class _WeightsOnlyBytes:
    """DCP's planners load non-tensor values with ``torch.load(weights_only=False)``; these never do."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = safe_load(value.getvalue(), f"DCP item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = obj  # type: ignore[attr-defined]


class _SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class _SafeExportPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


# -- export ---------------------------------------------------------------------------------------
def consolidated_model(store: CheckpointStore, info: CheckpointInfo) -> dict[str, Any]:
    """The full model state_dict of a sharded checkpoint, read in this one process (every byte vouched for):
    what ``checkpointing.export`` writes for a sharded checkpoint."""
    state: dict[str, Any] = {}
    reader = _VouchedReader(store, info, read_dcp_metadata(store, info))
    with _unwrapped():
        _load_state_dict(state, storage_reader=reader, planner=_SafeExportPlanner(keys={"model"}), no_dist=True)
    if "model" not in state:
        raise CheckpointError(f"{info.uri}: the sharded checkpoint holds no 'model' entry to export")
    return state["model"]


def _merged(everyone: list[dict[str, FileEntry]]) -> dict[str, FileEntry]:
    merged: dict[str, FileEntry] = {}
    for rank, entries in enumerate(everyone):
        for fname, entry in entries.items():
            if fname in merged and merged[fname] != entry:
                raise CheckpointError(f"{fname} was written by two ranks (rank {rank} and another)")
            merged[fname] = entry
    return merged


@contextmanager
def _single_process_quiet():
    """DCP warns that it "assumes" a single process even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextmanager
def _unwrapped():
    """DCP gathers every rank's failure into one CheckpointException; raise the first rank's own error, so
    that a CorruptCheckpointError stays one on every rank."""
    try:
        yield
    except CheckpointException as exc:
        rank, (error, _trace) = min(exc.failures.items())
        if isinstance(error, Exception):
            error.add_note(f"(on rank {rank})")
            raise error from None
        raise CheckpointError(str(exc)) from None
