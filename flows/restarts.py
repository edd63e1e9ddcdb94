"""Attempts, restarts and the way an attempt leaves: the Prefect side of a run's lifecycle.

Prefect's ``run_count`` starts at 1 and grows by one each time a flow run runs again. A run comes back for
two reasons: the restart automation rescheduled it after a crash (a state named ``AwaitingRestart``), or it was
preempted and rescheduled itself (``Preempted``). Only the first counts against ``max_restarts``: a spot machine
taken away is not a failure of the user's code.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort, TerminationSignal
from prefect.runtime import deployment, flow_run
from prefect.states import Running, Scheduled

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
    """How often this flow run ran again after a crash before this attempt: its runs after the first, less those
    that followed a preemption. (Not the number of ``AwaitingRestart`` states: a worker may report one death
    twice, and each report can reschedule the run.)"""
    runs_again = retries_of(flow_run.run_count)
    if not is_deployment_run() or runs_again == 0:
        return runs_again
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(UUID(flow_run.id))
    return max(runs_again - sum(1 for state in states if state.name == PREEMPTED), 0)


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


def superseded_by_this_flow_run(store: Any) -> bool:
    """Whether the writer that fenced this attempt out is a newer attempt of this same flow run."""
    fence = store.fence
    return bool(flow_run.id) and fence.read(fence.newest()).owner == flow_run.id


def leave_superseded() -> BaseException:
    """A newer attempt of this flow run owns it now: leave without touching its state."""
    return _abort_keeping_state("a newer attempt of this flow run took it over; this one leaves")


class KeepRunning:
    """While this attempt trains, undoes a late Crashed report of an earlier death: a worker reports one death
    twice, the second time after the restarted attempt (this one) is already running, and the run would show
    Crashed while it trains (and end Crashed: Prefect refuses Completed after Crashed). Polls the run's state every
    ``interval`` seconds and sets it back to Running. Deployment runs only; a no-op elsewhere."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> KeepRunning:
        if is_deployment_run() and flow_run.id:
            self._thread = threading.Thread(target=self._watch, args=(UUID(flow_run.id),), daemon=True,
                                            name="keep-running")  # fmt: skip
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 2)

    def _watch(self, run_id: UUID) -> None:
        while not self._done.wait(self.interval):
            try:
                with get_client(sync_client=True) as client:
                    state = client.read_flow_run(run_id).state
                    if state is not None and state.type == StateType.CRASHED and not self._done.is_set():
                        client.set_flow_run_state(run_id, Running(message=_ALIVE), force=True)
                        logger.warning("%s (%s); set back to Running", _ALIVE, state.message or "no message")
            except Exception as exc:  # the API is only a report: training goes on
                logger.debug("keep-running check failed: %s", exc)


_ALIVE = "a late Crashed report of an earlier attempt's death arrived while this attempt trains"
