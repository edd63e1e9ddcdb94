"""The product's worker outlives an API outage (deployments/worker.py, issue 44's fault matrix): Prefect's service loop
gives up after a few rounds of failed polls, which ended the worker, and its flow runs with it, ~47 s into a
PostgreSQL outage. Real Prefect loop, real httpx errors; only the interval is short."""

from __future__ import annotations

import anyio
import httpx
import prefect.workers.base
import pytest
from prefect.utilities.services import critical_service_loop

from deployments import worker


class Answered(Exception):
    """The API answered again: the test's way out of a loop that runs for ever."""


def polls(failures: int):
    calls = []

    async def poll() -> None:
        calls.append(1)
        if len(calls) <= failures:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        raise Answered

    return poll, calls


def test_prefects_loop_gives_up_in_an_outage_and_the_worker_loop_goes_on_until_the_api_answers():
    poll, calls = polls(failures=40)
    with pytest.raises(RuntimeError, match="error threshold"):
        anyio.run(lambda: critical_service_loop(poll, 0.001, backoff=4, printer=lambda *a: None))
    assert len(calls) == 12  # 4 rounds of 3 failures: what ended the worker

    poll, calls = polls(failures=40)
    with pytest.raises(Answered):
        anyio.run(lambda: worker.outliving_service_loop(poll, 0.001, backoff=4, printer=lambda *a: None))
    assert len(calls) == 41  # every failure outlived, then the answer


def test_the_workers_loops_are_the_outliving_ones(monkeypatch):
    monkeypatch.setattr(prefect.workers.base, "critical_service_loop", critical_service_loop)
    worker.outlive_api_outages()
    assert prefect.workers.base.critical_service_loop is worker.outliving_service_loop
