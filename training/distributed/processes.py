"""Child processes that must not outlive the process that started them, however it dies.

Prefect's temporary server, torchrun and its ranks are started by a process that may be SIGKILLed (an OOM kill, a
machine taken away): nothing then runs their cleanup code. On Linux the kernel can deliver a signal to a child
when its parent dies (``PR_SET_PDEATHSIG``): a child started with ``die_with_parent`` gets SIGKILL then. A process
started by someone else (a torchrun rank) asks for it itself with ``die_with_parent()``, and checks that its parent
is still the one it had (it may have died before the request).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

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
