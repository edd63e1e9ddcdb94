"""The waits of the end-to-end tests scale with the machine (tests/deadlines.py, issue 47): TEST_TIME_SCALE, or the
load per core clamped to 1-4; a wait that runs out names what it waited for and how long it waited."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import deadlines, procs


def test_test_time_scale_stretches_every_wait(monkeypatch):
    monkeypatch.setenv("TEST_TIME_SCALE", "3")
    assert deadlines.time_scale() == 3.0
    before = time.monotonic()
    assert before + 29 < deadlines.deadline(10) <= time.monotonic() + 30
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"the flag: not within 0 s \(0.1 s x load; TEST_TIME_SCALE sets it\)"):
        deadlines.wait_until(lambda: False, 0.1, "the flag")
    assert time.monotonic() - t0 >= 0.3  # 0.1 s x 3


def test_without_test_time_scale_the_load_per_core_sets_it_between_1_and_4(monkeypatch):
    monkeypatch.delenv("TEST_TIME_SCALE", raising=False)
    monkeypatch.setattr(deadlines.os, "getloadavg", lambda: (34.0, 0.0, 0.0))
    monkeypatch.setattr(deadlines.os, "cpu_count", lambda: 2)
    assert deadlines.time_scale() == 4.0
    monkeypatch.setattr(deadlines.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert deadlines.time_scale() == 1.0
    monkeypatch.setattr(deadlines.os, "getloadavg", lambda: (5.0, 0.0, 0.0))
    assert deadlines.time_scale() == 2.5


def test_a_wait_returns_what_it_found_and_fails_when_the_process_ended_first():
    assert deadlines.wait_until(lambda: "found", 1, "it") == "found"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    with pytest.raises(AssertionError, match="the process ended before the kill point"):
        deadlines.wait_until(lambda: False, 60, "the kill point", ended)
    with pytest.raises(AssertionError, match="never saw a report"):
        procs.wait_until(lambda: False, ended, "a report")


def test_procs_wait_until_scales_its_timeout(monkeypatch):
    monkeypatch.setenv("TEST_TIME_SCALE", "4")
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="never saw x"):
            procs.wait_until(lambda: False, running, "x", timeout=0.1, poll=0.01)
        assert time.monotonic() - t0 >= 0.4  # 0.1 s x 4
    finally:
        running.kill()
        running.wait()
