"""How long an end-to-end test waits for something, scaled with the machine: a wait that takes 20 s on a quiet
machine takes minutes at a load of 17 on 2 cores, and a fixed 120 s limit failed a kill test there (issue 47). One
helper for every such wait (tests/conftest.py re-exports it; tests/procs.py's ``wait_until`` uses it); no side
effects on import, so any test helper may use it."""

from __future__ import annotations

import os
import subprocess
import time


def time_scale() -> float:
    """How much longer than on a quiet machine a wait may take: TEST_TIME_SCALE, or the load per core now (1 to 4)."""
    given = os.environ.get("TEST_TIME_SCALE", "")
    if given:
        return float(given)
    return min(4.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def deadline(seconds: float) -> float:
    """``time.monotonic()`` at which a wait of ``seconds`` (on a quiet machine) gives up, scaled by the load."""
    return time.monotonic() + seconds * time_scale()


def wait_until(predicate, seconds: float, what: str, proc: subprocess.Popen | None = None, every: float = 0.0005):
    """Polls ``predicate`` until it returns something true (returned), for ``seconds`` scaled by the load; fails
    naming ``what`` if it never does, or if ``proc`` ended first; polls every ``every`` seconds."""
    scaled = seconds * time_scale()
    end = time.monotonic() + scaled
    while time.monotonic() < end:
        found = predicate()
        if found:
            return found
        assert proc is None or proc.poll() is None, f"the process ended before {what}"
        time.sleep(every)
    raise AssertionError(f"{what}: not within {scaled:.0f} s ({seconds} s x load; TEST_TIME_SCALE sets it)")
