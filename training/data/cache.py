"""Where a shard's bytes are read from: a local folder's shard in place, a remote store's shard whole into a local
cache folder bounded by ``cache_bytes`` (least recently used shards leave first), memory-mapped from there. Either way
the bytes are checked against the fingerprint the index recorded (training/data/index.py) before a sample is read.

The cache is shared by every process of the machine (loader workers, ranks, the read-ahead thread), so it is filled
under one file lock, and it is a folder of this user that nobody else may enter: a folder planted by another local
user (under a shared /tmp, say) is never adopted, since its files would be trained on as the shards."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from typing import IO

from checkpointing.errors import TierUnavailable
from checkpointing.host_tier.tier import private_dir
from checkpointing.io.storage import Storage
from training.data.index import INDEX_FILE, Shard, cache_folder, check_local, fetch
from training.exceptions import DataError

CACHE_ENV = "TRAIN_DATA_CACHE_DIR"


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "resumable-train", "shards")


def _size_error(storage: Storage, shard: Shard, size: int) -> DataError:
    return DataError(
        f"{storage.uri(shard.name)} is {size} bytes, the index says {shard.size}: the shard changed or was cut short; "
        f"restore it, or delete the index for a new run"
    )


def open_in_place(storage: Storage, shard: Shard) -> IO[bytes]:
    """A local folder's shard, opened where it lies, at its indexed size and with its indexed content."""
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


def cached_copy(storage: Storage, shard: Shard, root: str, max_bytes: int) -> str:
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
