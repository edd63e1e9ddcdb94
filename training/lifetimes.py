"""Child processes that must not outlive the process that started them, however it dies.

Prefect's temporary server, torchrun and its ranks are started by a process that may be SIGKILLed (an OOM kill, a
machine taken away): nothing then runs their cleanup code. On Linux the kernel can deliver a signal to a child
when its parent dies (``PR_SET_PDEATHSIG``): a child started with ``die_with_parent`` gets SIGKILL then. A process
started by someone else (a torchrun rank) asks for it itself with ``die_with_parent()``, and checks that its parent
is still the one it had (it may have died before the request).

A DataLoader worker started through multiprocessing's forkserver is the forkserver's child, not the training
process's: its parent-death signal, and PyTorch's own check that its parent is still there, watch the forkserver,
which lives as long as any of its children (each holds the forkserver's "alive" pipe). A SIGKILLed trainer left its
forkserver and its workers behind for ever, holding memory and the shard cache's open files (seen after the format
kill tests: 30 such processes). ``die_with(trainer)`` makes the worker exit when the trainer does.

Those loaders' queues hold named POSIX semaphores (``/dev/shm/sem.mp-*``): under forkserver a worker opens them by
name, and multiprocessing's resource tracker, a process of the trainer's group, unlinks them at the end. A SIGKILL of
the whole group (``kill -9 -PGID``, a job scheduler's or a cgroup OOM kill of every process of the job) takes the
tracker too, and each such run leaves its names behind (14 for a 2-worker run) until the machine restarts.
``remove_orphaned_semaphores``, called once per process before a loader starts its workers, removes the ones no
process can still use.

What they leave in the temporary folder: a killed process's own folder (a gang's, a node's, a sweep's trial files) is
removed by the next one of its kind once its pid is gone (``remove_stale_folders``); a process that leaves on purpose
without teardown (``exit_now``) still removes the folder multiprocessing made for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import select
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from typing import NoReturn

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send ``sig`` (SIGKILL unless told) to this process when its parent dies (Linux; elsewhere a
    no-op). Usable as a ``preexec_fn`` for children, or called by a process at its start."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def die_with_parent_now(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """``die_with_parent`` for a process already running: if the parent died before the request (it is no longer
    ``expected_parent``), exit at once."""
    die_with_parent(sig)
    if os.getppid() != expected_parent:
        os._exit(1)


def kill_group(pid: int) -> None:
    """SIGKILL to the process group led by ``pid`` (a child started with ``start_new_session=True``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def die_with(pid: int, *_: object) -> None:
    """Exits this process as soon as process ``pid`` has (a thread waits on a pidfd of it; Linux 5.3 and later,
    elsewhere a no-op). A DataLoader's ``worker_init_fn`` as ``functools.partial(die_with, os.getpid())``: the extra
    argument (the worker id) is ignored."""
    if pid == os.getpid() or not hasattr(os, "pidfd_open"):
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os._exit(1)
    except OSError:  # no pidfds here (an old kernel, a seccomp filter): the worker lives as it did before
        return

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os._exit(1)

    threading.Thread(target=wait, name=f"die-with-{pid}", daemon=True).start()


def remove_stale_folders(prefix: str, parent: str | None = None) -> list[str]:
    """Removes the folders ``<parent>/<prefix><pid>-<random>`` (``tempfile.mkdtemp(prefix=f"{prefix}{pid}-")``) whose
    process ``pid`` is gone: what a SIGKILLed process left, since it ran no cleanup. Only real folders owned by this
    user, by that exact form of name; never a link, a file, or the folder of a process that still exists (another
    user's included). ``parent``: the temporary folder. Returns the paths removed."""
    parent = parent or tempfile.gettempdir()
    form = re.compile(rf"{re.escape(prefix)}(\d{{1,10}})-[A-Za-z0-9_]{{1,32}}")
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        named = form.fullmatch(entry.name)
        if named is None or _exists(int(named.group(1))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts: its folder is not ours to judge)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def exit_now(code: int) -> NoReturn:
    """``os._exit(code)`` for a process that must leave without the interpreter's teardown (a rank: training/
    distributed/rank.py), less what that skips of multiprocessing's exit handler: the folder it made for this process
    (``<tmp>/pymp-*``, the loaders' forkserver socket) would otherwise stay in the temporary folder at every exit."""
    from multiprocessing import util

    with contextlib.suppress(OSError):
        shutil.rmtree(util.get_temp_dir(), ignore_errors=True)  # made now if it was not: nothing else to remove then
    os._exit(code)


SHM = "/dev/shm"
SEMAPHORE_PREFIX = "sem.mp-"  # multiprocessing's names (multiprocessing/synchronize.py, SemLock._make_name)
# A name younger than this stays even when nothing maps it: the margin for a process this one cannot see (another
# PID namespace sharing the folder) that made it and still has to pass it to a child.
ORPHAN_AGE_SECONDS = 300.0
_swept = threading.Event()  # once per process: a run's later loaders find nothing new of a killed group's


def remove_orphaned_semaphores(shm: str = SHM, older_than: float = ORPHAN_AGE_SECONDS) -> list[str]:
    """Removes this user's multiprocessing semaphores in ``shm`` that no live process maps and that were made more
    than ``older_than`` seconds ago, and returns their names. Such a name is garbage: every process that made or
    opened it maps its file until it closes it, so one mapped by none has lost its holders, and only a new
    ``sem_open`` by name could reach it (what a child does at its start, while its parent still maps it). Mapped is
    by the file (device and inode), not by its name: glibc makes a semaphore under a temporary name, maps it, then
    links the real name to it, so its maker's mapping reads ``/dev/shm/sem.XXXXXX (deleted)``. Another user's files,
    links and anything else are left; a failure to read or remove is not an error (a sweep is best effort, and never
    a reason for a run not to start)."""
    try:
        fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        candidates = _old_semaphores(fd, older_than)
        if not candidates:
            return []
        device = os.fstat(fd).st_dev
        mapped = _mapped_inodes(f"{os.major(device):02x}:{os.minor(device):02x}")
        removed = []
        for name, inode in candidates:
            if inode in mapped:
                continue
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)  # a sticky folder: only this user (or root) can replace its own name
                removed.append(name)
    finally:
        os.close(fd)
    if removed:
        log.info("removed %d named semaphores a killed process group left in %s", len(removed), shm)
    return removed


def remove_orphaned_semaphores_once() -> None:
    """``remove_orphaned_semaphores`` the first time a process calls it (before its first loader with workers)."""
    if sys.platform.startswith("linux") and not _swept.is_set():
        _swept.set()
        remove_orphaned_semaphores()


def _old_semaphores(fd: int, older_than: float) -> list[tuple[str, int]]:
    """This user's ``sem.mp-*`` files in the folder ``fd`` last written ``older_than`` seconds ago or more, with their
    inodes."""
    now, uid, old = time.time(), os.getuid(), []
    for name in os.listdir(fd):
        if not name.startswith(SEMAPHORE_PREFIX):
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid and now - st.st_mtime >= older_than:
            old.append((name, st.st_ino))
    return old


def _mapped_inodes(device: str) -> set[int]:
    """The inodes of the files on ``device`` (``maj:min`` in hex, as /proc/PID/maps writes it) that some process this
    one may inspect has mapped."""
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
                    if len(fields) > 4 and fields[3] == device:
                        mapped.add(int(fields[4]))
        except (OSError, ValueError):
            continue
    return mapped
