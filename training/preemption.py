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
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGXCPU")  # that may request a checkpoint
EXIT_CODE = 143  # 128 + SIGTERM: what a shell and a supervisor read as "terminated on request"
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


@dataclass(frozen=True)
class Stop:
    """What asked training to stop: ``kind`` is "signal" or "handover"; ``by`` is who asked for a handover."""

    kind: str
    reason: str
    at: float  # time.monotonic() when it was asked
    by: dict[str, Any] | None = None


class StopRequests:
    """The process's pending stop request (the first one wins), set from signal handlers and threads."""

    def __init__(self) -> None:
        self._stop: Stop | None = None
        self._lock = threading.Lock()

    def request(self, kind: str, reason: str, by: dict[str, Any] | None = None) -> None:
        with self._lock:
            if self._stop is None:
                self._stop = Stop(kind, reason, time.monotonic(), by)

    @property
    def current(self) -> Stop | None:
        return self._stop

    def clear(self) -> None:
        with self._lock:
            self._stop = None


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
def handling(names: list[str]) -> Iterator[None]:
    """Installs handlers that turn ``names`` into a stop request for the duration of the block (main thread only;
    elsewhere, a no-op: the main thread's handlers already cover the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in parse_signals(names):

        def handler(signum: int, _frame: Any) -> None:
            STOP.request("signal", f"preempted by {signal.Signals(signum).name}")

        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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
