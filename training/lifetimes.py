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
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading

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
