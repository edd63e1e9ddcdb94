"""The meeting points of a ``train_loop``'s ranks: every rank at the same call, or an error on every rank, never a hang.

``ctx.report``, ``ctx.get_checkpoint``, ``ctx.should_checkpoint`` and the loop's return run collectives when several
processes train. A loop that calls one of them on some ranks only (Ray's habit: ``if ctx.rank == 0: ctx.report(...)``)
would leave rank 0 in our collective and rank 1 in DDP's, both for ever, deaf to SIGTERM. So before each of them the
ranks meet (checkpointing/ranks.py's ``meet``: through the process group's key-value store, not a collective): a
rank that waits longer than ``timeout`` raises a ReportError saying where each rank was and what to do; ranks at
different points raise it at once; a stop request (a signal, a handover) ends the wait with ``Preempted``. The rank
that gives up leaves word in the store, so the others raise the same error when they next look.
"""

from __future__ import annotations

import itertools
import logging

from checkpointing import ranks
from training import preemption
from training.exceptions import ReportError
from training.preemption import Preempted
from training.unit.session import World

logger = logging.getLogger(__name__)

_LOOPS = itertools.count()  # train_loop calls in this process: the same sequence on every rank of a gang


class RankMeetings:
    """One ``train_loop`` call's meeting points on this rank (a no-op in a single process)."""

    def __init__(self, world: World):
        self.world = world
        self.family = f"own_loop/{next(_LOOPS)}"
        self.count = 0

    def meet(self, point: str, timeout: float, checkpoint: str | None, step: int) -> None:
        """Returns once every rank reached ``point`` as its next meeting point. Else raises ReportError (a rank missing
        after ``timeout`` seconds, or at another point), or ``Preempted`` (``checkpoint`` and ``step``: the run's
        newest report) when a stop is requested while this rank waits."""
        if self.world.size == 1:
            return
        self.count += 1
        key = f"{self.family}/{self.count}"
        meeting = ranks.meet(
            key,
            point,
            timeout,
            stopped=lambda: preemption.STOP.current is not None,
            on_slow=lambda missing: logger.warning(
                "rank %d waits at %s for %s (call it on every rank at the same point)",
                self.world.rank,
                point,
                _ranks(missing),
            ),
        )
        if meeting.agreed:
            return
        if meeting.failed is not None:
            raise ReportError(meeting.failed)
        stop = preemption.STOP.current
        if meeting.stopped and stop is not None:
            note = (
                f"{_ranks(meeting.missing)} never reached {point}; nothing new was committed (if the missing rank died, "
                f"this stop is torchrun's cleanup of its crash: the launcher decides)"
            )
            ranks.fail(key, f"rank {self.world.rank} stopped ({stop.reason}) while waiting at {point}")
            raise Preempted(stop, checkpoint, step, None, note)
        message = self._disagreement(meeting, timeout)
        ranks.fail(key, message)
        raise ReportError(message)

    def failure(self) -> ReportError | None:
        """The error of a rank that gave up waiting for this one, or None (a quick look, no waiting)."""
        if self.world.size == 1:
            return None
        try:
            why = ranks.failure(self.family)
        except Exception:  # the store is gone with the process that held it: nothing to add
            return None
        return ReportError(why) if why is not None else None

    def _disagreement(self, meeting: ranks.Meeting, timeout: float) -> str:
        where = "; ".join(f"rank {r}: {p or f'not there within {timeout:g} s'}" for r, p in meeting.points.items())
        return (
            f"ranks met at different points of train_loop ({where}), at meeting {self.count} (ctx.report / "
            f"ctx.get_checkpoint / ctx.should_checkpoint / the loop's return) of rank {self.world.rank}: when several "
            f"processes train, call ctx.report(...) (state=None is fine on ranks other than 0, whose state is the one "
            f"committed) and read ctx.should_checkpoint on every rank at the same point, not under "
            f"`if ctx.rank == 0`. A rank that is slower on purpose (an evaluation on rank 0 only) may be given "
            f"longer: ctx.report_timeout_seconds = 120"
        )


def _ranks(numbers: list[int]) -> str:
    return f"rank{'s' if len(numbers) != 1 else ''} {', '.join(map(str, numbers))}"
