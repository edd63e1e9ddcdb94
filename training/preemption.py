"""Preemption: a polite termination commits where training stands, then the process leaves.

A spot machine reclaimed, a Kubernetes pod evicted, a Slurm job at its time limit: all send SIGTERM (Slurm: the
signal of ``--signal``) and SIGKILL a grace period later (Kubernetes' ``terminationGracePeriodSeconds``, 30 s by
default). The handler only records the request (HF Trainer, NeMo and Lightning do the same); the training loop
acts on it at the next step boundary, where the state is whole: every rank agrees on that step (the flag is
combined across ranks, so one rank's signal is enough), a checkpoint is committed through the normal protocol
(manifest, ``latest``, fencing, retention; an upload in flight is finished first) and ``Preempted`` is raised,
which the flow turns into a state the restart picks up. The relaunch resumes at that sample and step.

A stop can also come from the run itself: a newer attempt of the same run that asks this one to hand over
(checkpointing/fencing.py's leases). It is handled the same way; ``Stop.kind`` tells them apart.

The checkpoint must fit in the grace period: if this run's own save times say it would not
(``preemption_grace_seconds``), none is started, the process leaves at once and says so.

Machines rarely stop with one signal: an operator's ``kill`` twice, ``docker stop`` after a ``kill``, an init that
forwards the signal while the platform sends it directly, Slurm signalling the step and the batch shell. From the
first signal until the process exits, later ones are noted on stderr and ignored (``handling(hold=True)`` leaves the
handler in place after its block): a second SIGTERM that reached Prefect's handler or the default action turned a
finishing preemption into a crash. A person at a terminal is the exception: a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGXCPU")  # that may request a checkpoint
EXIT_CODE = 143  # 128 + SIGTERM: what a shell and a supervisor read as "terminated on request"
INTERRUPTED = 130  # 128 + SIGINT: what a shell reads as "stopped by Ctrl-C"
_MARGIN_SECONDS = 2.0  # of the grace period kept for leaving (log shipping, process teardown)


class Preempted(BaseException):
    """Training stopped on request (a termination signal, or a newer attempt taking the run over). A
    BaseException, like KeyboardInterrupt: not a failure of the user's code, never caught by ``except
    Exception`` and never retried as one; the flow turns it into the run's next state."""

    def __init__(self, stop: Stop, checkpoint: str | None, step: int, seconds: float | None, note: str = ""):
        self.stop, self.checkpoint, self.step, self.seconds, self.note = stop, checkpoint, step, seconds, note
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.checkpoint and self.seconds is not None:
            saved = f"checkpoint {self.checkpoint} committed in {self.seconds:.1f} s"
        elif self.checkpoint:
            saved = f"nothing new to save: checkpoint {self.checkpoint} already holds it"
        else:
            saved = "no checkpoint yet: a relaunch starts from the beginning"
        return f"{self.stop.reason}: stopped at step {self.step}; {saved}{f'; {self.note}' if self.note else ''}"


StopKind = Literal["signal", "handover"]  # a polite signal, or a newer attempt taking the run over


@dataclass(frozen=True)
class Stop:
    """What asked training to stop: ``kind`` is "signal" or "handover"; ``by`` is who asked for a handover."""

    kind: StopKind
    reason: str
    at: float  # time.monotonic() when it was asked
    by: dict[str, Any] | None = None
    signum: int | None = None  # the signal that asked, if one did


def exit_code(stop: Stop) -> int:
    """The exit status of a process that stopped for ``stop``: 130 for Ctrl-C, else 143 ("terminated")."""
    return INTERRUPTED if stop.signum == signal.SIGINT else EXIT_CODE


class StopRequests:
    """The process's pending stop request (the first one wins), set from signal handlers and threads."""

    def __init__(self) -> None:
        self._stop: Stop | None = None
        self._lock = threading.Lock()
        self.ignored: list[str] = []  # the signals ignored after it, in order (the stop's log line names them)
        self.aborts = 0  # Ctrl-C presses after it, at a terminal

    def request(self, kind: StopKind, reason: str, by: dict[str, Any] | None = None, signum: int | None = None) -> None:
        with self._lock:
            if self._stop is None:
                self._stop = Stop(kind, reason, time.monotonic(), by, signum)

    @property
    def current(self) -> Stop | None:
        return self._stop

    def clear(self) -> None:
        with self._lock:
            self._stop = None
            self.ignored, self.aborts = [], 0


STOP = StopRequests()


def parse_signals(names: list[str]) -> list[signal.Signals]:
    """Signal names (``SIGTERM``, ``SIGUSR1``...) as signals; ValueError naming the option for anything else."""
    found = []
    for name in names:
        upper = str(name).upper()
        upper = upper if upper.startswith("SIG") else f"SIG{upper}"
        if upper not in SIGNALS or not hasattr(signal, upper):
            raise ValueError(f"preemption_signals={names!r}: {name!r} is not one of {', '.join(SIGNALS)}")
        found.append(signal.Signals[upper])
    return found


@contextlib.contextmanager
def handling(names: list[str], hold: bool = False, interactive: bool = False) -> Iterator[None]:
    """Installs handlers that turn ``names`` into a stop request for the duration of the block (main thread only;
    elsewhere, a no-op: the main thread's handlers already cover the process). A signal after the first is ignored,
    or, with ``interactive`` (a person at a terminal), a further Ctrl-C aborts. With ``hold``, a block that ends
    because of a stop leaves its handlers in place: the process is on its way out, and nothing may turn that exit into
    a death by signal (Prefect's own SIGTERM handler reports a crash)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in dict.fromkeys(parse_signals(names)):  # once each: a second install would "restore" our own handler

        def handler(signum: int, _frame: Any) -> None:
            if STOP.current is None:
                STOP.request("signal", _reason(signum), signum=signum)
            elif interactive and signum == signal.SIGINT:
                _abort()
            else:
                _note_ignored(signum)

        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        if not (hold and STOP.current is not None):
            for sig, old in previous.items():
                signal.signal(sig, old)
        else:
            atexit.register(_ignore_while_exiting, list(previous))


def _ignore_while_exiting(signals: list[signal.Signals]) -> None:
    """At exit, after a stop: the interpreter's finalisation puts SIG_DFL back in place of every Python handler
    (and runs none), so a further SIGTERM there would turn a clean exit into a death by signal. SIG_IGN survives it."""
    for sig in signals:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN)


def _reason(signum: int) -> str:
    return (
        "interrupted by Ctrl-C (SIGINT)" if signum == signal.SIGINT else f"preempted by {signal.Signals(signum).name}"
    )


def _note_ignored(signum: int) -> None:
    """Runs in a signal handler: appends and writes straight to the file descriptor, no logging (the main thread may
    hold the logging or Prefect queue locks that a handler would wait for) and nothing that can raise."""
    name = signal.Signals(signum).name
    STOP.ignored.append(name)
    with contextlib.suppress(OSError):  # stderr may be a pipe whose reader (a worker) is gone
        os.write(2, f"{name} ignored: this process is already stopping (checkpoint, then exit)\n".encode())


def _abort() -> None:
    """A second Ctrl-C at a terminal: stop now, through the caller's KeyboardInterrupt (one line, exit 130); a third
    does not wait for that either."""
    STOP.aborts += 1
    if STOP.aborts > 1:
        with contextlib.suppress(OSError):
            os.write(2, b"error: aborted by Ctrl-C\n")
        os._exit(INTERRUPTED)
    raise KeyboardInterrupt


def raise_if_requested(checkpoint: str | None = None, step: int = 0) -> None:
    """Raises ``Preempted`` when a stop was requested (a check at a point with nothing new to save)."""
    stop = STOP.current
    if stop is not None:
        raise Preempted(stop, checkpoint, step, None)


def agreed_stop(world_size: int) -> Stop | None:
    """The stop request every rank acts on at this step boundary: this process's, or any rank's (one signal is
    enough). Every rank must call it at the same boundary: with several ranks it is a collective."""
    local = STOP.current
    if world_size <= 1:
        return local
    import torch
    import torch.distributed as dist

    flag = torch.tensor([2 if local and local.kind == "handover" else 1 if local else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    if local is None:  # another rank was asked: this rank stops at the same step
        STOP.request("handover" if flag.item() == 2 else "signal", "stopped because another rank was preempted")
    return STOP.current


class SaveBudget:
    """Whether a checkpoint still fits in the grace period, judged from this run's own save times."""

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.estimate: float | None = None  # seconds one checkpoint took here (a running maximum, to be safe)

    def observe(self, seconds: float) -> None:
        self.estimate = seconds if self.estimate is None else max(seconds, 0.7 * self.estimate + 0.3 * seconds)

    def left(self, stop: Stop) -> float:
        return self.grace_seconds - (time.monotonic() - stop.at) - _MARGIN_SECONDS

    def fits(self, stop: Stop) -> bool:
        """True unless a save is known to take longer than the grace period has left. A handover has no
        deadline; a first save (no estimate yet) is tried."""
        if stop.kind == "handover" or self.estimate is None:
            return True
        return self.estimate <= self.left(stop)

    def why_not(self, stop: Stop) -> str:
        return (
            f"no checkpoint was started: one takes about {self.estimate or 0:.1f} s here and "
            f"{max(self.left(stop), 0):.1f} s of preemption_grace_seconds={self.grace_seconds:g} were left"
        )
