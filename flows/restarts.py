"""Attempts, restarts and the way an attempt leaves: the Prefect side of a run's lifecycle.

Prefect's ``run_count`` starts at 1 and grows by one each time a flow run runs again. A run comes back for
two reasons: the restart automation rescheduled it after a crash (a state named ``AwaitingRestart``), or it was
preempted and rescheduled itself (``Preempted``). Only the first counts against ``max_restarts``: a spot machine
taken away is not a failure of the user's code.
"""

from __future__ import annotations

import logging
import signal
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.exceptions import Abort, TerminationSignal
from prefect.runtime import deployment, flow_run
from prefect.states import Scheduled

from training.preemption import Preempted

logger = logging.getLogger(__name__)
RESTARTED = "AwaitingRestart"  # the state the restart automation sets (deployments/automations.py)
PREEMPTED = "Preempted"  # the state a preempted deployment run sets itself


def retries_of(run_count: int | None) -> int:
    """The runs after the first: a task run's retries, a flow run's runs again (0 for one not run yet)."""
    return max((run_count or 1) - 1, 0)


def flow_run_attempt() -> int:
    """This flow run's attempt, from 1 (1 outside a flow run)."""
    return flow_run.run_count or 1


def is_deployment_run() -> bool:
    """Whether this flow run was created from a deployment: its parameters come from whoever may create runs."""
    return bool(deployment.id)


def restart_count() -> int:
    """How often this flow run was restarted after a crash (rescheduled by the automation) before this attempt."""
    if not is_deployment_run() or flow_run_attempt() <= 1:
        return 0
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(UUID(flow_run.id))
    return sum(1 for state in states if state.name == RESTARTED)


def leave(stop: Preempted) -> BaseException:
    """The exception that ends a stopped attempt in the state that fits what stopped it:

    - a newer attempt of this same flow run took over (a duplicate restart): leave quietly, changing nothing of
      the shared flow run's state (Prefect's ``Abort`` exits the engine without proposing one);
    - Prefect asked to cancel it (its runner sends SIGTERM): cancelled, after the checkpoint;
    - a termination signal in a deployment run: rescheduled now (``Preempted``, a Scheduled state), so that a worker
      picks it up again without waiting for a crash to be noticed, and never shown as Failed;
    - anything else (a run outside a deployment, or taken over by another run): ``Preempted`` itself, which the
      caller sees (the CLI exits 143)."""
    logger.warning("%s%s", stop.describe(), "; the restart will resume from it" if stop.checkpoint else "")
    if stop.stop.kind == "handover":
        if flow_run.id and (stop.stop.by or {}).get("owner") == flow_run.id:
            return _abort_keeping_state("a newer attempt of this flow run took it over; this one leaves")
        return stop
    if _cancel_requested():
        return TerminationSignal(signal.SIGTERM)
    if is_deployment_run():
        return _reschedule(stop)
    return stop


def _cancel_requested() -> bool:
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:  # a Prefect without the runner's control channel: a SIGTERM is never a cancel
        return False
    return get_intent() == "cancel"


def _reschedule(stop: Preempted) -> BaseException:
    state: Any = Scheduled(name=PREEMPTED, message=stop.describe()[:1000])
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(flow_run.id), state, force=True)
    abort = Abort(f"preempted; rescheduled: {stop.describe()}")
    abort.state = state  # type: ignore[attr-defined]  # the engine records it instead of proposing a state
    return abort


def _abort_keeping_state(why: str) -> BaseException:
    logger.warning("%s", why)
    with get_client(sync_client=True) as client:
        state: Any = client.read_flow_run(UUID(flow_run.id)).state
    abort = Abort(why)
    abort.state = state  # type: ignore[attr-defined]
    return abort
