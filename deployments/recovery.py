"""Crash recovery that does not depend on seeing an event live: a sweep over the training runs, at start and every
few seconds, beside the automations (deployments/automations.py).

The automations react to events as they arrive. An event sent while the server or its database is down is lost; a
server that restarted has forgotten which events it processed, and holds a run's state event that follows one from
before the restart (a change less than 5 minutes after the previous one) for 15 minutes, waiting for that one
(Prefect's causal ordering). PostgreSQL killed under a stack at a run's first checkpoint left the run Crashed after
the stack came back, and no automation restarted it for those 15 minutes. The sweep reads the runs' states instead:

- a training run that is Running but sent no heartbeat (nor ``training.attempt.alive``) for the heartbeat-lost window,
  counted from no earlier than the sweeper's own start (heartbeats sent while the server was down are lost), is marked
  Crashed, as the heartbeat automation would (``force=False``: Prefect refuses it once the run has ended);
- a training run that is still Crashed when both restart automations had their chance (the window plus a margin after
  the Crashed state) and that shows no sign of life within the window (a late second Crashed report of a death that
  was already restarted leaves the live attempt under a Crashed state) is moved to Scheduled ``AwaitingRestart``,
  exactly as the automation does.

Never twice: the restart is proposed only for the same Crashed state the sweep read (read again just before), with
Prefect's ``force=False`` rules and a ``transition_id`` derived from that state's id, so two sweepers (the stack's and
a worker's) proposing the same restart get one accepted (Prefect's PreventDuplicateTransitions). The restart event
also answers the third automation, which would otherwise restart the same crash. The cap is the flow's, as for the
automation: an attempt past ``max_restarts`` ends the run Failed (flows/train.py), which nothing here matches; a
newer attempt fences out an older one in the store (checkpointing/fencing.py).

What the sweep cannot stop: when a held Crashed event is finally evaluated, 15 minutes on, both restart automations
act on the run as it is then. Seen here: a run the sweep had restarted, Completed 13 minutes before, was rescheduled
again and ran once more (Completed at once, no unit trained: the run was complete); a run still training then would be
taken over by the newer attempt through the store's fencing and resume from its last checkpoint.

    python -m deployments.recovery                  # every 30 s, for train/default and retrain/nightly
    python -m deployments.recovery --once           # one sweep, then exit
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
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
from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.states import Crashed, Scheduled, to_state_create

from deployments.automations import DEFAULT_DEPLOYMENTS, RESTART_MISSED, heartbeat_seconds

logger = logging.getLogger("deployments.recovery")
RESTARTED = "AwaitingRestart"  # the state the restart automation sets (flows/restarts.py reads the same name)
LIFE = ["prefect.flow-run.heartbeat", "training.attempt.alive"]  # what a live attempt sends (flows/restarts.py)
MARGIN_SECONDS = 30.0  # after the automations' window: the third automation fires at its end, give it time to act
INTERVAL_SECONDS = 30.0
PAGE = 200
TRANSITIONS = uuid.UUID("7b0f6a52-3c1e-4d55-9a57-4f0c1b0e9d21")  # namespace of the sweep's transition ids


@dataclass(frozen=True)
class Windows:
    """How long silence and an unanswered Crashed must last before the sweep acts."""

    silent: timedelta  # no heartbeat this long: the process is gone (the heartbeat automation's ``within``)
    settle: timedelta  # a Crashed this old that nothing restarted: the automations missed it
    watching_since: datetime  # silence counts from no earlier than this: beats sent while the server was down are lost

    @classmethod
    def of(cls, silent_seconds: float, watching_since: datetime, margin_seconds: float = MARGIN_SECONDS) -> Windows:
        silent = timedelta(seconds=silent_seconds)
        return cls(silent, silent + timedelta(seconds=margin_seconds), watching_since)


def sweep(client: SyncPrefectClient, deployment_ids: list[UUID], windows: Windows) -> list[UUID]:
    """One pass over the runs of these deployments: marks the silent Running ones Crashed, restarts the stranded
    Crashed ones; returns the ids of the runs it restarted."""
    restarted = []
    for run in _runs(client, deployment_ids, [StateType.RUNNING, StateType.CRASHED]):
        if run.state is None:
            continue
        if run.state.type == StateType.RUNNING:
            _crash_if_silent(client, run, windows)
        elif _stranded(client, run, windows) and _restart(client, run):
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
    """Marks Crashed a Running run that has sent a sign of life, but none within ``windows.silent``. A run that never
    sent one (heartbeats turned off) cannot be told from a dead one, and is left alone, as the automation does."""
    assert run.state is not None
    last = _last_life(client, run.id, since=run.state.timestamp)
    if last is None:
        return
    silent_since = max(last, run.state.timestamp, windows.watching_since)
    silence = _now() - silent_since
    if silence < windows.silent:
        return
    state: Any = Crashed(
        message=f"no heartbeat for {silence.total_seconds():.0f}s: the flow-run process is gone "
        "(found by the recovery sweep, deployments/recovery.py)"
    )
    result = client.set_flow_run_state(run.id, state, force=False)
    if result.status == SetStateStatus.ACCEPT:
        logger.warning(
            "flow run %s (%s): no heartbeat for %.0fs, marked Crashed", run.id, run.name, silence.total_seconds()
        )


def _stranded(client: SyncPrefectClient, run: FlowRun, windows: Windows) -> bool:
    """Crashed long enough ago that the automations would have restarted it, and not alive after all."""
    assert run.state is not None
    now = _now()
    if now - run.state.timestamp < windows.settle:
        return False
    return _last_life(client, run.id, since=now - windows.silent) is None


def _restart(client: SyncPrefectClient, run: FlowRun) -> bool:
    """Moves the run from the Crashed state the sweep read to Scheduled ``AwaitingRestart``; False if anything else
    changed it first, or another sweeper already made this very transition."""
    crashed = run.state
    assert crashed is not None
    current = client.read_flow_run(run.id).state
    if current is None or current.id != crashed.id:
        return False
    state: State = Scheduled(
        name=RESTARTED,
        message=f"restarted after a crash ({crashed.timestamp:%H:%M:%S} UTC) "
        "that no automation restarted: the recovery sweep",
    )
    if _propose(client, run.id, state, uuid.uuid5(TRANSITIONS, str(crashed.id))) != SetStateStatus.ACCEPT:
        return False
    logger.warning(
        "flow run %s (%s): Crashed since %s and not restarted; rescheduled (%s)",
        run.id,
        run.name,
        f"{crashed.timestamp:%Y-%m-%d %H:%M:%S} UTC",
        RESTARTED,
    )
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


def silent_seconds(client: SyncPrefectClient, deployment_ids: list[UUID]) -> float:
    """The heartbeat-lost window: the installed third automation's ``within`` (the same as the heartbeat
    automation's), else three heartbeats, as ``python -m deployments.automations`` would install."""
    for automation in client.read_automations_by_name(name=RESTART_MISSED):
        within = getattr(automation.trigger, "within", None)
        if within:
            return within.total_seconds()
    return 3.0 * heartbeat_seconds(client, deployment_ids)


def deployment_ids(client: SyncPrefectClient, names: list[str]) -> list[UUID]:
    """The ids of the deployments that exist among ``names`` (the stack's sweeper may start before a deploy)."""
    found = []
    for name in names:
        try:
            found.append(client.read_deployment_by_name(name).id)
        except Exception as missing:  # ObjectNotFound, or the server not up yet: the next pass tries again
            logger.debug("deployment %s: %s", name, missing)
    return found


def sweep_once(names: list[str], watching_since: datetime, margin_seconds: float = MARGIN_SECONDS) -> list[UUID]:
    """One sweep over the named deployments' runs, with the windows the installed automations use."""
    with get_client(sync_client=True) as client:
        ids = deployment_ids(client, names)
        windows = Windows.of(silent_seconds(client, ids), watching_since, margin_seconds)
        return sweep(client, ids, windows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s recovery: %(message)s", stream=sys.stdout)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request, every 30 s: only what was done
    names = args.deployments or list(DEFAULT_DEPLOYMENTS)
    if args.once:
        return _by_hand(names)
    logger.info("sweeping the crashed runs of %s every %.0fs", ", ".join(names), args.interval)
    watching_since = _now()  # silence counts from here: heartbeats sent before, while the server was down, are lost
    while True:
        try:
            sweep_once(names, watching_since)
        except Exception as exc:  # the server or its database is down: it is what this sweeper outlives
            logger.warning("sweep failed (%s: %s); next in %.0fs", type(exc).__name__, exc, args.interval)
        time.sleep(args.interval)


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
