"""The one restart authority of the training deployments: a reconciler that reads each run's current state and
state history, and restarts a crash once (DESIGN.md section 6; docs/deployments.md, "Who restarts a crash").

Why a reconciler and not an automation: Prefect's automations act on events as they were, not on the run as it is.
A Crashed event held after a server restart (Prefect's causal ordering holds a state event that follows one from
before the restart) is evaluated ~15 minutes later, and an automation's ``ChangeFlowRunState`` then reschedules the
run whatever state it is in by then: a Completed run was restarted that way, and so was one whose automation bucket
insert had failed with ``database is locked``. An automation cannot read the current state; this can. So:

- ``decide`` (a pure function of a run's state history, the time and whether its attempt showed life since) restarts
  only a run whose *current* state is ``Crashed`` (never Completed, Failed, Cancelled, Scheduled or Running), once
  that Crashed has settled for ``GRACE_SECONDS`` with no sign of life after it (a live attempt under a Crashed state
  is a late second report of a death already restarted: the worker's ``exited with non-zero status code -9``);
- the restart is proposed with ``force=False`` and a ``transition_id`` derived from the death (the id of the first
  Crashed state since the attempt's Running state), and only if the run's state is still the Crashed state read:
  two reconcilers at once (the stack's and the worker's) get one restart (Prefect's PreventDuplicateTransitions
  refuses a transition that repeats the current state's transition id);
- the one liveness authority too (no automation marks silence: deployments/automations.py says why): a Running
  run that sent a heartbeat (or ``training.attempt.alive``) and then nothing for the heartbeat window,
  counted from no earlier than this reconciler's start, nor than the last pass the API failed or the server stored
  none of its events (``Vigil``: a held SQLite write lock, a database outage), is marked Crashed (evidence; restarted
  on a later pass). A run of a deployment whose runs send heartbeats that has none stored at all is judged from its
  Running state (killed seconds after it started, its first beats lost with the database); a run of a deployment
  without heartbeats that never sent a sign of life is never marked;
- every restart counts against ``max_restarts``: the flow counts its runs again, preemptions included
  (flows/restarts.py), and ends Failed past the cap; Failed is never restarted.

The reconciler runs every ``INTERVAL_SECONDS`` in the product's worker (deployments/worker.py) and in the stack
(``python -m deployments.stack up``); a crash is restarted ``GRACE_SECONDS`` to ``GRACE_SECONDS + INTERVAL_SECONDS``
after it was recorded.

    python -m deployments.recovery                  # every few seconds, for the training deployments
    python -m deployments.recovery --once           # one pass, then exit
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.client.schemas.responses import DeploymentResponse, OrchestrationResult, SetStateStatus
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.states import Crashed, Scheduled, to_state_create

from deployments.automations import DEFAULT_DEPLOYMENTS, sends_heartbeats, window_seconds
from training.run_states import ATTEMPT_DIED  # a subflow a restarted attempt ended: never a death to restart
from training.run_states import AWAITING_RESTART as RESTARTED  # flows/restarts.py reads the same name

logger = logging.getLogger("deployments.recovery")
LIFE = ["prefect.flow-run.heartbeat", "training.attempt.alive"]  # what a live attempt sends (flows/restarts.py)
GRACE_SECONDS = 15.0  # > flows/restarts.py's ALIVE_SECONDS (5) twice plus the event's way into the database
INTERVAL_SECONDS = 3.0
PAGE = 200
PROBE = "training.reconciler.pass"  # the reconciler's own event each pass: is the server storing events? (Vigil)
STALL_SECONDS = 20.0  # a probe not stored this long after it was sent: the server stores no events (Vigil)
TRANSITIONS = uuid.UUID("7b0f6a52-3c1e-4d55-9a57-4f0c1b0e9d21")  # namespace of the restarts' transition ids


@dataclass(frozen=True)
class Windows:
    """How long silence and a Crashed state must last before the reconciler acts."""

    silent: timedelta  # no heartbeat this long: the process is gone (``python -m deployments.automations --within``)
    settle: timedelta  # a Crashed this old, with no life after it, is a death to restart
    watching_since: datetime  # silence counts from no earlier than this: beats sent while the server was down are lost
    beating: frozenset[UUID] = frozenset()  # deployments whose runs send heartbeats: a run of one is never beatless

    @classmethod
    def of(
        cls, silent_seconds: float, watching_since: datetime, margin_seconds: float | None = None,
        settle_seconds: float = GRACE_SECONDS, beating: frozenset[UUID] = frozenset(),
    ) -> Windows:  # fmt: skip
        """``margin_seconds``, if given, settles a crash ``silent_seconds + margin_seconds`` after it (tests)."""
        silent = timedelta(seconds=silent_seconds)
        settle = silent + timedelta(seconds=margin_seconds) if margin_seconds is not None else None
        return cls(silent, settle if settle is not None else timedelta(seconds=settle_seconds), watching_since, beating)


@dataclass(frozen=True)
class Decision:
    """What the reconciler does with one run: restart it (with this transition id) or not, and why."""

    restart: bool
    why: str
    transition_id: UUID | None = None


def death_of(history: list[State]) -> State | None:
    """The Crashed state that recorded the current attempt's death: the first Crashed since its last Running state
    (a second report of the same exit, landing on the restart's Scheduled or Pending state, is the same death)."""
    runnings = [i for i, state in enumerate(history) if state.type == StateType.RUNNING]
    since = history[runnings[-1] + 1 :] if runnings else history
    return next((state for state in since if state.type == StateType.CRASHED and state.name != ATTEMPT_DIED), None)


def decide(history: list[State], now: datetime, alive_since_crash: bool, settle: timedelta) -> Decision:
    """Whether to restart a run whose state history (oldest first) is ``history``. Only from ``Crashed``."""
    if not history:
        return Decision(False, "no state")
    current = history[-1]
    if current.type != StateType.CRASHED or current.name == ATTEMPT_DIED:
        return Decision(False, f"{current.type.value} ({current.name}): only a Crashed run is restarted")
    if now - current.timestamp < settle:
        return Decision(False, "Crashed moments ago: waiting for a sign of life that would make it a late report")
    if alive_since_crash:
        return Decision(False, "its attempt sent a sign of life after the Crashed: a late report, not a death")
    death = death_of(history) or current
    return Decision(True, f"Crashed at {death.timestamp:%H:%M:%S} UTC", uuid.uuid5(TRANSITIONS, str(death.id)))


def sweep(client: SyncPrefectClient, deployment_ids: list[UUID], windows: Windows) -> list[UUID]:
    """One pass over the runs of these deployments: marks the silent Running ones Crashed, restarts the Crashed ones
    ``decide`` says to; returns the ids of the runs it restarted."""
    restarted = []
    for run in _runs(client, deployment_ids, [StateType.RUNNING, StateType.CRASHED]):
        if run.state is None:
            continue
        if run.state.type == StateType.RUNNING:
            _crash_if_silent(client, run, windows)
        elif _restart(client, run, windows.settle):
            restarted.append(run.id)
    return restarted


def _runs(client: SyncPrefectClient, deployment_ids: list[UUID], types: list[StateType]) -> Iterator[FlowRun]:
    if not deployment_ids:
        return
    runs_filter = FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=deployment_ids),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=types)),
    )
    offset = 0
    while page := client.read_flow_runs(flow_run_filter=runs_filter, limit=PAGE, offset=offset):
        yield from page
        offset += len(page)


def _crash_if_silent(client: SyncPrefectClient, run: FlowRun, windows: Windows) -> None:
    """Marks Crashed a Running run with no sign of life within ``windows.silent``. Silence counts from its last
    sign of life; for a run of a deployment whose runs send heartbeats (``windows.beating``) that has none stored at
    all, from its Running state: a run killed seconds after it started, its first heartbeats lost with the database
    that died under it, is as dead as one that beat for an hour. A run of a deployment without heartbeats that never
    sent one cannot be told from a dead one, and is left alone."""
    assert run.state is not None
    last = _last_life(client, run.id, since=run.state.timestamp)
    if last is None and run.deployment_id not in windows.beating:
        return
    silent_since = max(last or run.state.timestamp, run.state.timestamp, windows.watching_since)
    silence = _now() - silent_since
    if silence < windows.silent:
        return
    what = "no heartbeat" if last is not None else "no heartbeat stored since it started running"
    state: Any = Crashed(
        message=f"{what} for {silence.total_seconds():.0f}s: the flow-run process is gone "
        "(found by the recovery sweep, deployments/recovery.py)"
    )
    result = client.set_flow_run_state(run.id, state, force=False)
    if result.status == SetStateStatus.ACCEPT:
        logger.warning(
            "flow run %s (%s): %s for %.0fs, marked Crashed", run.id, run.name, what, silence.total_seconds()
        )


def _restart(client: SyncPrefectClient, run: FlowRun, settle: timedelta = timedelta(0)) -> bool:
    """Moves the run from the Crashed state read to Scheduled ``AwaitingRestart`` if ``decide`` says so; False if
    anything else changed it first, or another reconciler already made this very transition."""
    crashed = run.state
    assert crashed is not None
    history = sorted(client.read_flow_run_states(run.id), key=lambda state: state.timestamp)
    if not history or history[-1].id != crashed.id:
        return False  # it moved on since it was read
    alive = _last_life(client, run.id, since=crashed.timestamp) is not None
    decision = decide(history, _now(), alive, settle)
    if not decision.restart or decision.transition_id is None:
        logger.debug("flow run %s (%s): not restarted: %s", run.id, run.name, decision.why)
        return False
    state: State = Scheduled(name=RESTARTED, message=f"restarted after a crash ({decision.why}): the reconciler")
    if _propose(client, run.id, state, decision.transition_id) != SetStateStatus.ACCEPT:
        return False
    logger.warning("flow run %s (%s): %s; rescheduled (%s)", run.id, run.name, decision.why, RESTARTED)
    return True


def _propose(client: SyncPrefectClient, run_id: UUID, state: State, transition_id: UUID) -> SetStateStatus:
    """``client.set_flow_run_state(force=False)`` with a transition id of ours: the client draws a random one, and
    Prefect rejects a transition only when it repeats the id of the one that made the current state."""
    state_create = to_state_create(state)
    state_create.state_details.flow_run_id = run_id
    state_create.state_details.transition_id = transition_id
    response = client.request(
        "POST",
        "/flow_runs/{id}/set_state",
        path_params={"id": run_id},
        json={"state": state_create.model_dump(mode="json", serialize_as_any=True), "force": False},
    )
    response.raise_for_status()
    return OrchestrationResult.model_validate(response.json()).status


def _last_life(client: SyncPrefectClient, run_id: UUID, since: datetime) -> datetime | None:
    """When the run last sent a heartbeat or an attempt-alive event since ``since``, if it did."""
    page = client.read_events(
        EventFilter(
            occurred=EventOccurredFilter(since=since, until=_now() + timedelta(minutes=5)),
            event=EventNameFilter(name=LIFE),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"]),
        ),
        limit=1,
    )
    return max((event.occurred for event in page.events), default=None)


def _now() -> datetime:
    return datetime.now(UTC)


class Vigil:
    """Since when this reconciler has seen the server store what runs send: its start, and again after any pass
    whose API call failed or whose own probe event the server did not store within ``stall_seconds``.

    A run's silence counts only from then. The server can answer reads while it stores no event (SQLite with a write
    transaction held by another process, a database outage's backlog): a run's heartbeats of that time are lost or
    late, and its silence is the server's. Seen in the fault matrix (bench/fault_matrix.py, 2026-12-06): a run training
    through 2 minutes of a held SQLite write lock was marked ``Crashed: no heartbeat for 63s`` 12 s after the lock
    went, while alive, then Completed over it."""

    def __init__(self, stall_seconds: float = STALL_SECONDS):
        self.since = _now()
        self.stall = timedelta(seconds=stall_seconds)
        self.resource = f"training.reconciler.{uuid.uuid4()}"
        self.probing_since: datetime | None = None
        self.stalled = False

    def check(self, client: SyncPrefectClient) -> datetime:
        """Sends this pass's probe, reads the newest one stored, and returns ``since`` (moved to now on a stall)."""
        from prefect.events import emit_event

        now = _now()
        emit_event(event=PROBE, resource={"prefect.resource.id": self.resource})
        self.probing_since = self.probing_since or now
        page = client.read_events(
            EventFilter(
                occurred=EventOccurredFilter(since=self.probing_since, until=now + timedelta(minutes=5)),
                event=EventNameFilter(name=[PROBE]),
                resource=EventResourceFilter(id=[self.resource]),
            ),
            limit=1,
        )
        newest = max((event.occurred for event in page.events), default=self.probing_since)
        if now - newest > self.stall:
            if not self.stalled:
                logger.warning(
                    "the server has stored none of this reconciler's events for %.0fs: silence counts from when it "
                    "stores them again", (now - newest).total_seconds(),
                )  # fmt: skip
            self.stalled, self.since = True, now
        elif self.stalled:
            self.stalled = False
            logger.info("the server stores events again: silence counts from %s", f"{self.since:%H:%M:%S} UTC")
        return self.since

    def failed(self) -> None:
        self.since = _now()


def deployments(client: SyncPrefectClient, names: list[str]) -> list[DeploymentResponse]:
    """The deployments that exist among ``names`` (the stack's sweeper may start before a deploy)."""
    found = []
    for name in names:
        try:
            found.append(client.read_deployment_by_name(name))
        except Exception as missing:  # ObjectNotFound, or the server not up yet: the next pass tries again
            logger.debug("deployment %s: %s", name, missing)
    return found


def sweep_once(names: list[str], watching_since: datetime) -> list[UUID]:
    """One pass over the named deployments' runs, with the server's heartbeat window (deployments/automations.py)."""
    with get_client(sync_client=True) as client:
        return _pass(client, names, watching_since)


def _pass(client: SyncPrefectClient, names: list[str], watching_since: datetime) -> list[UUID]:
    found = deployments(client, names)
    beating = frozenset(d.id for d in found if sends_heartbeats(d))
    windows = Windows.of(window_seconds(client, found), watching_since, beating=beating)
    return sweep(client, [d.id for d in found], windows)


def reconcile_forever(
    names: list[str], interval: float = INTERVAL_SECONDS, stop: threading.Event | None = None
) -> None:
    """Passes every ``interval`` seconds until ``stop`` is set; an API that does not answer is logged and outlived."""
    stop = stop or threading.Event()
    vigil = Vigil()  # silence counts from its ``since``: heartbeats sent while the server was down are lost
    while not stop.is_set():
        try:
            with get_client(sync_client=True) as client:
                _pass(client, names, vigil.check(client))
        except Exception as exc:  # the server or its database is down: it is what this reconciler outlives
            vigil.failed()
            logger.warning("reconcile failed (%s: %s); next in %.0fs", type(exc).__name__, exc, interval)
        stop.wait(interval)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s recovery: %(message)s", stream=sys.stdout)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request, every 30 s: only what was done
    names = args.deployments or list(DEFAULT_DEPLOYMENTS)
    if args.once:
        return _by_hand(names)
    logger.info("reconciling the crashed runs of %s every %.0fs", ", ".join(names), args.interval)
    reconcile_forever(names, args.interval)
    return 0


def _by_hand(names: list[str]) -> int:
    """One sweep, trusting the heartbeats (whoever runs it knows the server has been up); 1 if the API failed."""
    try:
        restarted = sweep_once(names, watching_since=datetime.min.replace(tzinfo=UTC))
    except Exception as exc:
        logger.error("sweep failed (%s: %s)", type(exc).__name__, exc)
        return 1
    found = ", ".join(map(str, restarted)) if restarted else "nothing to restart"
    logger.info("swept %s: %s", ", ".join(names), found)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deployments.recovery", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--deployment",
        action="append",
        dest="deployments",
        help=f"flow/deployment whose crashed runs to restart (repeatable; default: {DEFAULT_DEPLOYMENTS})",
    )
    parser.add_argument("--interval", type=float, default=INTERVAL_SECONDS, help="seconds between sweeps")
    parser.add_argument("--once", action="store_true", help="one sweep, then exit (1 if the API did not answer)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
