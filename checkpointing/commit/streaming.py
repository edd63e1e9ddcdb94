"""Checkpoint files written and read as streams: hashed on the way, never a second copy in memory.

``CheckpointStore.save`` serializes each file into one bytes object and then writes it: with the
``BytesIO`` growing by reallocation, a save holds the state about three times over. Here ``torch.save``
writes straight into the object store's file handle through ``HashingWriter``, which counts and hashes
every byte as it passes, so the manifest entry is ready when the file is closed and the state is held
once. The same writer backs the DCP shards (``sharded.py``).

Files are opened through the store's ``Storage``, so a local run folder's links are never followed
(checkpointing/io/localfs.py); object stores have no links.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, cast

import torch

from checkpointing.io.hashing import BackgroundSha256
from checkpointing.io.storage import Storage
from checkpointing.manifest import FileEntry, Writer
from checkpointing.store import (
    CHECKPOINTS,
    CheckpointInfo,
    CheckpointStore,
    validate_file_name,
)

_CHUNK = 16 * 1024 * 1024
_OVERLAP = 1024 * 1024  # writes this big hash on a helper thread while the bytes go out (both release the GIL)
# An object store's file handle buffers a block, then copies it (and the HTTP layer may copy it again) to send
# one part. fsspec's 50 MiB default blocks, plus a whole tensor handed over in one write, made a streamed
# 206 MB save peak at 2.5x the state on S3 (moto); 8 MiB parts fed in 2 MiB slices hold ~50 MB in flight,
# whatever the state's size. Parts grow only for files too big for S3's 10,000 parts at 8 MiB (80 GB).
_MIB = 1024 * 1024
_MIN_BLOCK, _UNKNOWN_SIZE_BLOCK, _MAX_PARTS = 8 * _MIB, 64 * _MIB, 9000  # 10% spare below S3's 10,000
_SLICE = 2 * _MIB


class HashingWriter:
    """A write-only stream that passes bytes to ``raw`` and keeps their count and sha256.

    ``tell`` counts bytes written, which is all DCP and ``torch.save`` ask of a position. Not an
    ``io.IOBase``: its finalizer would flush ``raw`` after the store closed it."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.size = 0
        self._digest = BackgroundSha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _OVERLAP:
            # The caller may reuse its buffer once write returns: the hash is awaited before returning.
            self._digest.submit(view)
            for start in range(0, len(view), _SLICE):
                self.raw.write(view[start : start + _SLICE])
            self._digest.wait()
        else:
            self._digest.update(view)
            self.raw.write(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        """DCP fsyncs local shards through it without flushing first: flush here, or the tail of the
        buffered file would not be on disk when the fsync returns."""
        self.raw.flush()
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()  # DCP closes its streams itself; the store's handle then closes again, a no-op

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def entry(self) -> FileEntry:
        return FileEntry(size=self.size, sha256=self._digest.hexdigest())


def remote_block_size(size_hint: int | None) -> int:
    """Part size for an object of about ``size_hint`` bytes: small parts bound memory, big files need big ones."""
    if size_hint is None:
        return _UNKNOWN_SIZE_BLOCK
    return max(_MIN_BLOCK, -(-size_hint // (_MAX_PARTS * _MIB)) * _MIB)


@contextmanager
def open_for_write(storage: Storage, key: str, size_hint: int | None = None) -> Iterator[IO[bytes]]:
    """A binary file handle to write ``key`` (about ``size_hint`` bytes); a local link there is removed, never
    written through (see checkpointing/io/localfs.py)."""
    with storage.open_write(key, block_size=remote_block_size(size_hint)) as f:
        yield f


def write_object(storage: Storage, key: str, obj: Any) -> FileEntry:
    """``torch.save(obj)`` straight into ``key``; its size and sha256, taken on the way."""
    try:
        with open_for_write(storage, key, size_hint=tensor_bytes(obj) + _MIB) as raw:
            stream = HashingWriter(raw)
            torch.save(obj, cast(IO[bytes], stream))  # it has what torch.save uses: write (and flush)
            stream.flush()
    except BaseException:
        _remove_quietly(storage, key)  # a torn file is never listed by a manifest; do not leave it about
        raise
    return stream.entry()


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in nested dicts, lists and tuples (about what ``torch.save`` will write)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _remove_quietly(storage: Storage, key: str) -> None:
    with contextlib.suppress(Exception):  # best effort: the next save of this name clears the folder anyway
        storage.delete(key)


def save_streaming(
    store: CheckpointStore,
    name: str,
    objects: dict[str, Any],
    *,
    progress: dict[str, int],
    metadata: dict[str, Any] | None = None,
    writer: Writer | None = None,
) -> CheckpointInfo:
    """``CheckpointStore.save`` without the in-memory copy: each file is streamed into the store while it is
    hashed, then the manifest and ``latest`` are committed. Same files, same manifest, same checks."""
    for fname in objects:
        validate_file_name(fname)
    writer = writer or Writer.current()
    store.begin_commit(name, writer)
    entries = {f: write_object(store.storage, f"{CHECKPOINTS}/{name}/{f}", obj) for f, obj in objects.items()}
    return store.commit_files(name, entries, progress=progress, metadata=metadata, writer=writer)
