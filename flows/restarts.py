"""Attempts, restarts and the way an attempt leaves: the Prefect side of a run's lifecycle.

Prefect's ``run_count`` starts at 1 and grows by one each time a flow run runs again. A run comes back for
two reasons: the reconciler restarted it after a crash (a state named ``AwaitingRestart``, deployments/recovery.py),
or it was preempted and rescheduled itself (``Preempted``). Both count against ``max_restarts``: a "preemption" can
be a crash in disguise (a rank's death whose cleanup SIGTERM reached the survivors), and one that repeats at the same
step must end Failed, not loop for ever.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentTaskRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.exceptions import Abort, TerminationSignal
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled, Crashed, Scheduled

from tasks.trial import UNTRUSTED_ENV as UNTRUSTED_TRIAL_ENV
from training.preemption import STOP, Preempted
from training.run_states import ATTEMPT_DIED, PREEMPTED, SUPERSEDED

logger = logging.getLogger(__name__)
UNFINISHED = [StateType.PENDING, StateType.SCHEDULED, StateType.RUNNING]


def retries_of(run_count: int | None) -> int:
    """The runs after the first: a task run's retries, a flow run's runs again (0 for one not run yet)."""
    return max((run_count or 1) - 1, 0)


def flow_run_attempt() -> int:
    """This flow run's attempt, from 1 (1 outside a flow run)."""
    return flow_run.run_count or 1


def is_deployment_run() -> bool:
    """Whether this flow run was created from a deployment: its parameters come from whoever may create runs.

    Read from the run's context, with no API call: ``prefect.runtime.deployment.id`` reads the flow run from the API
    on every call outside a deployment (0.05-0.15 s each, twice a run). Prefect's engine puts a deployment run's id in
    its ``_deployment_id`` context variable, which its subflows inherit (a subflow of a deployment run counts as one);
    without that variable, ``deployment.id`` decides as before."""
    try:
        from prefect.context import _deployment_id
    except ImportError:  # another Prefect: ask the API, as deployment.id does
        return bool(deployment.id)
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return bool(deployment.id)
    return bool(_deployment_id.get() or context.flow_run.deployment_id)


def parameters_untrusted() -> bool:
    """Whether this run's configuration came from whoever may create flow runs: a deployment run's parameters, or a
    trial that a deployment run of a sweep started in a process of its own (it says so in the child's environment,
    which the worker's side writes, never a parameter)."""
    return is_deployment_run() or os.environ.get(UNTRUSTED_TRIAL_ENV) == "1"


def restart_count() -> int:
    """How often this flow run ran again before this attempt, whatever brought it back (a crash's restart or a
    preemption's reschedule): its runs after the first."""
    return retries_of(flow_run.run_count)


def leave(stop: Preempted) -> BaseException:
    """The exception that ends a stopped attempt in the state that fits what stopped it:

    - a newer attempt of this same flow run took over (a duplicate restart): leave quietly, changing nothing of
      the shared flow run's state (Prefect's ``Abort`` exits the engine without proposing one);
    - Prefect asked to cancel it (its runner sends SIGTERM): cancelled, after the checkpoint;
    - a termination signal in a deployment run: rescheduled now (``Preempted``, a Scheduled state), so that a worker
      picks it up again without waiting for a crash to be noticed, and never shown as Failed;
    - a run outside a deployment: Cancelled, named ``Preempted`` (``Superseded`` when another run took it over),
      never Crashed; ``train()``'s caller still gets the ``Preempted`` (flows/train.py; the CLI exits 143, 130 for
      Ctrl-C);
    - a run taken over by another flow run of the same ``run_name`` (fenced out, checkpointing/fencing.py): Cancelled,
      named ``Superseded``, deployment runs included: never Crashed, so the reconciler never reschedules it to take
      the run back (the ping-pong of two flow runs of one name)."""
    logger.warning("%s%s", stop.describe(), "; the restart will resume from it" if stop.checkpoint else "")
    if STOP.ignored:
        ignored = ", ".join(STOP.ignored)
        logger.warning("%d further signal(s) ignored while this attempt stopped: %s", len(STOP.ignored), ignored)
    if stop.stop.kind == "handover":
        if flow_run.id and (stop.stop.by or {}).get("owner") == flow_run.id:
            return _abort_keeping_state("a newer attempt of this flow run took it over; this one leaves")
        return _end_stopped(stop)
    if _cancel_requested():
        return TerminationSignal(signal.SIGTERM)
    if is_deployment_run():
        return _reschedule(stop)
    return _end_stopped(stop)


class StoppedRun(Abort):
    """A flow run ended on request (its state, Cancelled ``Preempted``, is set already): Prefect's engine takes an
    ``Abort`` carrying a state as the run's end, where a ``Preempted`` (a BaseException) would read as a crash
    ("Crash detected! ... unexpected exception", two ERROR lines, Crashed). ``stop`` is what the caller sees."""

    def __init__(self, stop: Preempted, state: Any):
        super().__init__(stop.describe())
        self.stop, self.state = stop, state


def _end_stopped(stop: Preempted) -> BaseException:
    """Ends a flow run that nothing will reschedule (one started from the CLI or Python) Cancelled, named after the
    stop like its task run (tasks/train_unit.py); the person relaunches it. Without a flow run: the stop itself."""
    if not flow_run.id:
        return stop
    name = PREEMPTED if stop.stop.kind == "signal" else SUPERSEDED
    state: Any = Cancelled(name=name, message=stop.describe()[:1000])
    try:
        with get_client(sync_client=True) as client:
            state = client.set_flow_run_state(UUID(flow_run.id), state, force=True).state or state
    except Exception as exc:  # the API is gone (a shutting-down machine): the caller still sees the stop
        logger.debug("could not end the flow run %s: %s", name, exc)
        return stop
    return StoppedRun(stop, state)


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


def end_dead_attempts() -> int:
    """Ends the task runs that earlier attempts of this flow run left Running, Pending or Scheduled: a SIGKILLed
    attempt ends none of its own, and the UI would show them Running (a bar past the end of a Completed run) or
    Pending forever. Each becomes Crashed, named ``AttemptDied``, saying which attempt took over; so does a subflow
    run such a task run started (retrain's train), with its task runs. Called as a
    restarted attempt starts, before it creates a task run; a task run records the attempt that ran it
    (``flow_run_run_count``, 0 for one that never ran), so this attempt's are never touched. Returns how many it
    ended; the API failing is a warning, never a reason not to train."""
    attempt = flow_run_attempt()
    if attempt <= 1 or not flow_run.id:
        return 0
    try:
        return _end_task_runs_before(UUID(flow_run.id), attempt)
    except Exception as exc:
        logger.warning("could not end the task runs an earlier attempt left unfinished: %s", exc)
        return 0


def _end_task_runs_before(flow_run_id: UUID, attempt: int) -> int:
    took_over = f"attempt {attempt} took the run over and resumes from the last checkpoint"
    ended = 0
    with get_client(sync_client=True) as client:
        dead = [r for r in _unfinished_task_runs(client, flow_run_id) if r.flow_run_run_count < attempt]
        for run in dead:  # flow_run_run_count: 0 for one that never ran, else the attempt that ran it
            ran_in = f"attempt {run.flow_run_run_count}" if run.flow_run_run_count else "an earlier attempt"
            ended += _end(
                client.set_task_run_state, run.id, f"{ran_in} of this flow run died before ending it; {took_over}"
            )
        # A subflow such a task run started (retrain's train) died with it, and so did the subflow's task runs.
        for child in _unfinished_subflows(client, [r.id for r in dead]) if dead else []:
            why = f"the attempt of its parent flow run that ran it died; {took_over}"
            ended += _end(client.set_flow_run_state, child.id, why)
            for run in _unfinished_task_runs(client, child.id):
                ended += _end(client.set_task_run_state, run.id, why)
    if ended:
        logger.info("%d run(s) an earlier attempt left unfinished are now Crashed (%s)", ended, ATTEMPT_DIED)
    return ended


def _unfinished_task_runs(client: Any, flow_run_id: UUID) -> list[Any]:
    unfinished = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED)))
    return client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), task_run_filter=unfinished
    )


def _unfinished_subflows(client: Any, parent_task_run_ids: list[UUID]) -> list[Any]:
    unfinished = FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED))
    parents = FlowRunFilterParentTaskRunId(any_=parent_task_run_ids)
    return client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_task_run_id=parents, state=unfinished))


def _end(set_state: Any, run_id: UUID, message: str) -> int:
    """Sets a run Crashed, named AttemptDied (its state event is ``prefect.flow-run.AttemptDied``: the restart
    automation, which reacts to ``prefect.flow-run.Crashed``, never sees it)."""
    set_state(run_id, Crashed(name=ATTEMPT_DIED, message=message), force=True)
    return 1


def superseded_by_this_flow_run(store: Any) -> bool:
    """Whether the writer that fenced this attempt out is a newer attempt of this same flow run."""
    fence = store.fence
    return bool(flow_run.id) and fence.read(fence.newest()).owner == flow_run.id


def leave_superseded() -> BaseException:
    """A newer attempt of this flow run owns it now: leave without touching its state."""
    return _abort_keeping_state("a newer attempt of this flow run took it over; this one leaves")


ALIVE_EVENT = "training.attempt.alive"  # the reconciler reads it (deployments/recovery.py)
ALIVE_SECONDS = 5.0  # the reconciler waits GRACE_SECONDS (15) for one after a Crashed


class AttemptAlive:
    """While this attempt of a deployment run trains, emits ``training.attempt.alive`` every ``ALIVE_SECONDS``,
    labelled with the run's id and ``run_count``: the reconciler (deployments/recovery.py) must tell this attempt
    (alive, after a late Crashed report of the previous one, or between two of Prefect's heartbeats that arrive late)
    from an attempt that died, within seconds (Prefect's heartbeats come every 30 s at the least).

    Only the deployment's own flow run beats, since the reconciler watches that run: a subflow (retrain's train) has
    an id and a ``run_count`` of its own, and its beats would speak for a run nobody watches. retrain beats for
    itself; the train subflow inside it adds nothing. A no-op outside deployment runs."""

    _beating = threading.Event()  # one per process: the deployment run's, entered first

    def __init__(self, interval: float = ALIVE_SECONDS):
        self.interval = interval
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> AttemptAlive:
        context = FlowRunContext.get()
        own = context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None
        if own and flow_run.id and not AttemptAlive._beating.is_set():
            AttemptAlive._beating.set()
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
            AttemptAlive._beating.clear()

    def _beat(self, resource: dict[str, str], related: list[dict[str, str]]) -> None:
        from prefect.events import emit_event

        while True:
            try:
                emit_event(event=ALIVE_EVENT, resource=resource, related=related)
            except Exception as exc:  # the API is only a report: training goes on
                logger.debug("could not emit %s: %s", ALIVE_EVENT, exc)
            if self._done.wait(self.interval):
                return
