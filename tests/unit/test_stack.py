"""The local stack's settings (deployments/stack.py) without starting anything: how many threads a worker's flow
runs get."""

from __future__ import annotations

import os

from deployments import stack as stacks


def test_a_worker_gives_its_flow_runs_one_thread_less_than_the_cores_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert stacks.worker_threads() == max(1, cores - 1)

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert stacks.worker_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: the default
    assert stacks.worker_threads() == max(1, cores - 1)
