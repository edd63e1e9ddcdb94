"""The one automation the training deployments install, and why there is no restart automation (DESIGN.md section 6).

``training: heartbeat lost -> crashed``: a *deployment* run of the training deployments that sent a heartbeat (every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds) and then neither a heartbeat nor an end state for ``within`` seconds
is marked Crashed (its machine died and nothing is left to report it). It is evidence only: Prefect refuses Crashed
over an ended run (``force=False``; Completed, Failed and Cancelled are terminal), and a run that never sends
heartbeats (a CLI ``python -m flows.sweep`` against a stack's server: not a deployment run) is never matched.

Nothing here restarts a run. The restart automations this module used to install (``training: crashed -> restart``
and ``training: crash not restarted -> restart``) acted on events as they were: a Crashed event held ~15 minutes after
a server restart, or re-read after a ``database is locked`` bucket insert, rescheduled a run that had Completed in
the meantime, and the worker's late second Crashed report of one death opened a second restart window. The one
restart authority is the reconciler (deployments/recovery.py), which reads the run's current state; installing
removes those two automations where an older install left them.

Created idempotently, by name (an existing one is updated in place):

    python -m deployments.automations --deployment train/default --deployment retrain/nightly --deployment sweep/default
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from uuid import UUID

from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import StateType
from prefect.settings import get_current_settings

from training.run_states import ATTEMPT_DIED, AWAITING_RESTART, PREEMPTED, flow_run_event

HEARTBEAT_LOST = "training: heartbeat lost -> crashed"
RESTART_CRASHED = "training: crashed -> restart"  # removed: deployments/recovery.py restarts (see above)
RESTART_MISSED = "training: crash not restarted -> restart"  # removed, as RESTART_CRASHED
OBSOLETE = (RESTART_CRASHED, RESTART_MISSED)
DEFAULT_DEPLOYMENTS = ("train/default", "retrain/nightly", "sweep/default")
HEARTBEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
MIN_HEARTBEAT_SECONDS = 30  # Prefect's own floor for the heartbeat frequency
# What proves a run alive or finished. Not `prefect.flow-run.*`: on SQLite, every matching event is a
# bucket write in the triggers service, and a write that collides with a state change fails, is retried, then
# dropped, after which Prefect holds that run's later events for up to 15 minutes. Crashed is left out: a run
# already Crashed is refused another Crashed anyway; this one only has to notice silence. A preempted run's Scheduled state
# (named Preempted, flows/restarts.py; events carry the state's name) is in: the run waits for a worker without
# heartbeats, and marking it Crashed replaced its "Preempted" state (seen when the worker stopped with the machine:
# Crashed 60 s later, then restarted as a crash).
ALIVE_OR_DONE = {
    "prefect.flow-run.heartbeat",
    flow_run_event(PREEMPTED),
    flow_run_event(AWAITING_RESTART),  # the reconciler restarted it: it waits for a worker, without heartbeats
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Cancelling",
    "prefect.flow-run.Paused",
    "prefect.flow-run.Suspended",
    flow_run_event(ATTEMPT_DIED),  # a subflow of a dead attempt, ended by the restarted one (flows/restarts.py)
}


def heartbeat_lost(deployment_ids: list[UUID], within_seconds: float) -> Automation:
    """Marks Crashed any run of these deployments that sent nothing for ``within_seconds`` after a heartbeat."""
    return Automation(
        name=HEARTBEAT_LOST,
        description="A training deployment run whose heartbeats stopped (its machine died) is marked Crashed; "
        "the reconciler (deployments/recovery.py) restarts it.",
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={"prefect.flow-run.heartbeat"},
            expect=ALIVE_OR_DONE,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={  # deployment runs only: a CLI run against the server may send no heartbeats
                "prefect.resource.role": "deployment",
                "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids],
            },
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED, message=f"no heartbeat for {within_seconds:.0f}s: the flow-run process is gone"
            )
        ],
    )


def upsert(automation: Automation) -> Automation:
    """Creates the automation, or updates the one with the same name (and removes any duplicates)."""
    existing = _by_name(automation.name)
    if not existing:
        return automation.create()  # type: ignore[return-value]  # the sync form (Prefect's sync_compatible)
    automation.id = existing[0].id
    automation.update()
    for duplicate in existing[1:]:
        duplicate.delete()
    return automation


def _by_name(name: str) -> list[Automation]:
    with get_client(sync_client=True) as client:
        return [Automation(**a.model_dump()) for a in client.read_automations_by_name(name=name)]


def heartbeat_seconds(client: SyncPrefectClient, deployment_ids: list[UUID]) -> int:
    """The heartbeat frequency the deployments' runs use: their job variables' env, else this process's setting."""
    values = []
    for deployment_id in deployment_ids:
        env = (client.read_deployment(deployment_id).job_variables or {}).get("env") or {}
        if env.get(HEARTBEAT_SETTING):
            values.append(int(env[HEARTBEAT_SETTING]))
    setting = get_current_settings().flows.heartbeat_frequency or 180
    return max(max(values, default=setting), MIN_HEARTBEAT_SECONDS)


def install(deployment_names: list[str], within_seconds: float | None = None) -> list[Automation]:
    """Creates or updates the heartbeat automation for these deployments (``flow/deployment`` names), and deletes the
    restart automations an older install left (the reconciler restarts, deployments/recovery.py)."""
    with get_client(sync_client=True) as client:
        ids = [client.read_deployment_by_name(name).id for name in deployment_names]
        frequency = heartbeat_seconds(client, ids)
    within = within_seconds if within_seconds is not None else 3 * frequency
    if within <= frequency:
        raise ValueError(
            f"within={within}s: must exceed the heartbeat frequency ({frequency}s), or every "
            f"healthy run would be marked Crashed; use about 3x the frequency"
        )
    for name in OBSOLETE:
        for automation in _by_name(name):
            automation.delete()
    return [upsert(heartbeat_lost(ids, within))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.automations", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--deployment",
        action="append",
        dest="deployments",
        help=f"flow/deployment whose silent runs to mark Crashed (repeatable; default: {DEFAULT_DEPLOYMENTS})",
    )
    parser.add_argument(
        "--within",
        type=float,
        default=None,
        help="seconds without any event of a run before it counts as dead (default: 3x heartbeat)",
    )
    args = parser.parse_args(argv)
    for automation in install(args.deployments or list(DEFAULT_DEPLOYMENTS), args.within):
        print(f"automation {automation.name!r} ({automation.id}): {automation.trigger.describe_for_cli().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
