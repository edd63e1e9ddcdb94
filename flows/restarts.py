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
from prefect.exceptions import Abort, TerminationSignal
from prefect.runtime import deployment, flow_run
from prefect.states import Scheduled

from tasks.train_unit import PREEMPTED
from training.preemption import STOP, Preempted

logger = logging.getLogger(__name__)
RESTARTED = "AwaitingRestart"  # the state the restart automation sets (deployments/automations.py)


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
      caller sees (the CLI exits 143; 130 for Ctrl-C)."""
    logger.warning("%s%s", stop.describe(), "; the restart will resume from it" if stop.checkpoint else "")
    if STOP.ignored:
        ignored = ", ".join(STOP.ignored)
        logger.warning("%d further signal(s) ignored while this attempt stopped: %s", len(STOP.ignored), ignored)
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
        state = client.set_flow_run_state(UUID(flow_run.id), state, force=True).state or state
    _settled(state)
    abort = Abort(f"preempted; rescheduled: {stop.describe()}")
    abort.state = state  # type: ignore[attr-defined]  # the engine records it instead of proposing a state
    return abort


def _settled(state: Any) -> None:
    """Tells Prefect that this attempt's outcome is settled, so that nothing after it reports a crash:

    - the runner (a worker's or ``serve()``'s) gets the engine's outcome receipt now, not at the engine's end, and
      so ignores how the process exits: a later signal, even a SIGKILL, no longer makes it propose Crashed over
      the Scheduled state (Prefect sends a receipt itself only for final states);
    - the engine's SIGTERM handling takes the flow run's state as owned elsewhere (the intent Prefect's runner uses
      when it reschedules a run on shutdown): it leaves our handler in place (training/preemption.py's hold) instead
      of restoring the default action, which a second SIGTERM during the process's exit then met.

    Both are Prefect internals (3.8): without them, the exit is as safe as the engine's own teardown."""
    try:
        from prefect._internal import control_listener
        from prefect._internal.attempt_control import EngineOutcomeReceipt
    except ImportError:
        return
    if state.id is not None:
        receipt = EngineOutcomeReceipt.state_reported(
            state_id=state.id, state_type=state.type.value, state_name=state.name
        )
        control_listener.report_engine_outcome(receipt)
    control_listener._set_intent("reschedule")


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


ALIVE_EVENT = "training.attempt.alive"  # deployments/automations.py's third automation listens for it
ALIVE_SECONDS = 10.0


class AttemptAlive:
    """While this attempt of a deployment run trains, emits ``training.attempt.alive`` every ``ALIVE_SECONDS``,
    labelled with the run's ``run_count``: Prefect's own heartbeats say a flow run is alive, not *which attempt*,
    and the automation that restarts a crash nothing else restarted must tell this attempt (alive, after a late
    Crashed report of the previous one) from a second attempt that died. A no-op outside deployment runs."""

    def __init__(self, interval: float = ALIVE_SECONDS):
        self.interval = interval
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> AttemptAlive:
        if is_deployment_run() and flow_run.id:
            resource = {
                "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                "prefect.run-count": str(flow_run_attempt()),
            }
            related = [
                {"prefect.resource.id": f"prefect.deployment.{deployment.id}", "prefect.resource.role": "deployment"}
            ]
            self._thread = threading.Thread(
                target=self._beat, args=(resource, related), daemon=True, name="attempt-alive"
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 2)

    def _beat(self, resource: dict[str, str], related: list[dict[str, str]]) -> None:
        from prefect.events import emit_event

        while True:
            try:
                emit_event(event=ALIVE_EVENT, resource=resource, related=related)
            except Exception as exc:  # the API is only a report: training goes on
                logger.debug("could not emit %s: %s", ALIVE_EVENT, exc)
            if self._done.wait(self.interval):
                return
