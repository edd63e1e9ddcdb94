"""Counting attempts: Prefect's ``run_count`` starts at 1 and grows by one with each retry of a task run,
and with each restart of a flow run (an automation rescheduling it after a crash). Everything that reports
or caps restarts and retries counts them here, the same way.
"""

from __future__ import annotations

from prefect.runtime import flow_run


def retries_of(run_count: int | None) -> int:
    """The runs after the first: a task run's retries, a flow run's restarts (0 for one not run yet)."""
    return max((run_count or 1) - 1, 0)


def flow_run_attempt() -> int:
    """This flow run's attempt, from 1 (1 outside a flow run)."""
    return flow_run.run_count or 1


def restart_count() -> int:
    """How often this flow run was restarted after a crash before this attempt."""
    return retries_of(flow_run.run_count)
