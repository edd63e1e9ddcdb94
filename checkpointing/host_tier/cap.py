"""The host-memory tier's bound: how many bytes one user's snapshots may hold in shared memory, all runs together.

``/dev/shm`` is RAM. Every run that is killed and never relaunched keeps its snapshots there (up to three copies of
its state) until a cleaner removes them (checkpointing/host_tier/gc.py), so without a bound a machine's memory fills
run by run. The cap is the worker's to set, never a run's: ``TRAIN_HOST_TIER_MAX_BYTES`` in the environment, as a
number of bytes (``8000000000``), with a unit (``512M``, ``8G``: powers of 1024) or as a share of the tier's file
system (``25%``). Unset, it is ``DEFAULT_SHARE`` of that file system's size, so most of ``/dev/shm`` stays free for
everything else. A buffer that would take the user's snapshots past the cap is refused (``TierFull``): the snapshot
stays in private memory and still reaches the store, with one warning; training goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
from collections.abc import Iterator

from checkpointing.errors import TierUnavailable

CAP_ENV = "TRAIN_HOST_TIER_MAX_BYTES"
DEFAULT_SHARE = 0.25  # of the tier's file system: three quarters of /dev/shm stay free for everything else
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_VALUE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*|\s*(\d+(?:\.\d+)?)\s*%\s*", re.IGNORECASE)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
skipped_over_cap = 0  # snapshot buffers this process was refused because of the cap (a counter for people and tests)


class TierFull(TierUnavailable):
    """A new snapshot buffer would take this user's snapshots past the cap."""


def cap_bytes(fd: int) -> int:
    """The cap for the tier on the file system of folder ``fd``; TierUnavailable naming the variable if it is bad."""
    raw = os.environ.get(CAP_ENV, "")
    size = _filesystem_bytes(fd)
    if not raw.strip():
        return int(size * DEFAULT_SHARE)
    match = _VALUE.fullmatch(raw)
    if match is None or (match.group(3) is not None and not 0 < float(match.group(3)) <= 100):
        raise TierUnavailable(
            f"{CAP_ENV}={raw!r} is not a size: give bytes (8000000000), a size with a unit (512M, 8G) or a share of "
            f"the tier's file system (25%)"
        )
    if match.group(3) is not None:
        return int(size * float(match.group(3)) / 100)
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _filesystem_bytes(fd: int) -> int:
    st = os.fstatvfs(fd)
    return st.f_blocks * st.f_frsize


def used_bytes(user_fd: int) -> int:
    """Bytes this user's snapshots take (every run folder's files, as allocated): links and strangers' entries are
    not followed and not counted."""
    total = 0
    for run_fd in _run_folders(user_fd):
        try:
            total += folder_bytes(run_fd)
        finally:
            os.close(run_fd)
    return total


def folder_bytes(run_fd: int) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.listdir(run_fd):
            with contextlib.suppress(OSError):
                st = os.stat(entry, dir_fd=run_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    total += max(st.st_size, st.st_blocks * 512)
    return total


def _run_folders(user_fd: int) -> Iterator[int]:
    with contextlib.suppress(OSError):
        for name in os.listdir(user_fd):
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=user_fd)
            except OSError:
                continue
            if os.fstat(fd).st_uid != os.getuid():
                os.close(fd)
                continue
            yield fd


@contextlib.contextmanager
def allocation_lock(user_fd: int) -> Iterator[None]:
    """Held while a buffer is measured against the cap and reserved: two processes never both fit in the last room."""
    fcntl.flock(user_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(user_fd, fcntl.LOCK_UN)


def check_room(user_fd: int, size: int, shown: str, what: str = "buffer") -> None:
    """TierFull when ``size`` more bytes would take this user's snapshots past the cap (the caller holds the lock)."""
    global skipped_over_cap
    st = os.fstatvfs(user_fd)
    if size > st.f_bavail * st.f_frsize:  # the file system itself cannot hold it: that, not the cap, is the reason
        raise TierUnavailable(f"{shown}: {size / 1e6:.0f} MB cannot be reserved (not enough shared memory)")
    cap, used = cap_bytes(user_fd), used_bytes(user_fd)
    if used + size > cap:
        skipped_over_cap += 1
        raise TierFull(
            f"{shown}: a {size / 1e6:.1f} MB {what} would take this user's snapshots past the cap ({used / 1e6:.1f} "
            f"MB held of {cap / 1e6:.1f} MB, {CAP_ENV}); `python -m checkpointing gc` lists abandoned ones"
        )
