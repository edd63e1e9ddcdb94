"""Where a run's start-up went, phase by phase (issue 46): one clause of the run's first log line.

A trial segment of a sweep paid ~10 s around ~0.3 s of training on a loaded machine; without a breakdown nobody can
tell which phase to cut. ``Phases`` times consecutive spans (each ``mark(name)`` ends the span that began at the
previous mark); the training flow (flows/train.py) marks its restart checks, ``Run.open`` (training/run.py) its own
phases, and the line ``run ... training to 2ep; start-up 0.41 s (restart checks 0.00 s, trust 0.00 s, preflight
0.07 s, ...)`` says it. A warm trial runner (flows/sweep_trial.py) starts the clock when it is handed a segment
(``handed_over``) and marks its reset between segments, so the spans before the flow body (``reset``, then ``flow
run``: reading the spec, Prefect creating the flow run) are in the line too. Nothing of Prefect here: the clock is
plain ``time.perf_counter``.
"""

from __future__ import annotations

import time

_pending: Phases | None = None


class Phases:
    """The spans of one start-up, in the order they were first marked; a name marked twice adds up."""

    def __init__(self, since: float | None = None):
        self._last = time.perf_counter() if since is None else since
        self.spans: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Ends the span that began at the previous mark (or at ``since``), naming it ``name``."""
        now = time.perf_counter()
        self.spans[name] = self.spans.get(name, 0.0) + max(now - self._last, 0.0)
        self._last = now

    @property
    def total(self) -> float:
        return sum(self.spans.values())

    def line(self) -> str:
        """``start-up 0.41 s (restart checks 0.00 s, preflight 0.07 s, ...)``; empty before any mark."""
        if not self.spans:
            return ""
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.spans.items())
        return f"start-up {self.total:.2f} s ({parts})"


def handed_over() -> Phases:
    """Called as a warm trial runner is handed a segment: the next run's start-up counts from now (the runner marks
    its own spans on the clock returned)."""
    global _pending
    _pending = Phases()
    return _pending


def starting() -> Phases:
    """The clock of a run's start-up, called as the training flow's body begins: the hand-over's, when a warm runner
    started one (its span ``flow run`` ends here), else a new one from now. A hand-over's clock is used once."""
    global _pending
    phases, _pending = _pending, None
    if phases is None:
        return Phases()
    phases.mark("flow run")
    return phases
