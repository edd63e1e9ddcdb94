"""The two automations that bring a training run back after its machine died (DESIGN.md section 6).

Prefect retries a flow run only when it ends Failed; a run whose process or machine died ends Crashed,
or, when nothing is left to report it, stays Running forever. So the deployment ships:

1. ``training: heartbeat lost -> Crashed``: flow runs of the training flows send a heartbeat every
   ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds; a run that sends neither a heartbeat nor an end state
   for about three heartbeats is marked Crashed.
2. ``training: crashed -> restart``: a Crashed run of a training deployment is moved back to Scheduled
   (named ``AwaitingRestart``). A worker runs the same flow-run id again, with ``run_count`` + 1; its
   units resume from the last checkpoint. The flow ends Failed past ``max_restarts`` (Failed is not
   matched, so the loop stops).

One death can be reported Crashed twice: the runner reports the process's exit, and the worker reports it
again up to ~20 s later, by which time the restarted attempt is already running. Rescheduling on both started a
second attempt beside the first (which then hit FencedError and set the run Failed). So the restart fires once
per run within ``RESTART_DEBOUNCE_SECONDS`` (Prefect's reactive triggers wait out their window after firing);
a late report may still mark the running attempt's run Crashed (it goes on, and ends Completed: Prefect allows
Crashed -> Completed), and a newer attempt takes a run over only after the older one handed over
(checkpointing/fencing.py). A real second
crash inside that window is not lost: its run stops sending heartbeats, and automation 1 reports it again
after ``within`` (> the debounce, checked at install): automation 3, ``training: crash not restarted -> restart``,
reschedules a Crashed run that nothing followed (no restart, heartbeat or later state) for that long.

Both are created idempotently, by name (an existing one is updated in place):

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

HEARTBEAT_LOST = "training: heartbeat lost -> crashed"
RESTART_CRASHED = "training: crashed -> restart"
RESTART_MISSED = "training: crash not restarted -> restart"
DEFAULT_DEPLOYMENTS = ("train/default", "retrain/nightly", "sweep/default")
HEARTBEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
RESTART_DEBOUNCE_SECONDS = 45.0  # > the ~20 s between a death's two Crashed reports; < any heartbeat window
MIN_HEARTBEAT_SECONDS = 30  # Prefect's own floor for the heartbeat frequency
# What proves a run alive or finished. Not `prefect.flow-run.*`: on SQLite, every matching event is a
# bucket write in the triggers service, and a write that collides with the restart action's state change
# fails, is retried (restarting the run again each time), then dropped, after which Prefect holds that
# run's later events (its next Crashed too) for up to 15 minutes. Crashed is left out on purpose: a crash
# already has the restart automation; this one only has to notice silence. A preempted run's Scheduled state
# (named Preempted, flows/restarts.py; events carry the state's name) is in: the run waits for a worker without
# heartbeats, and marking it Crashed replaced its "Preempted" state (seen when the worker stopped with the machine:
# Crashed 60 s later, then restarted as a crash).
ALIVE_OR_DONE = {
    "prefect.flow-run.heartbeat",
    "prefect.flow-run.Preempted",
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Cancelling",
    "prefect.flow-run.Paused",
    "prefect.flow-run.Suspended",
    "prefect.flow-run.AttemptDied",  # a subflow of a dead attempt, ended by the restarted one (flows/restarts.py)
}


def heartbeat_lost(flow_ids: list[UUID], within_seconds: float) -> Automation:
    """Marks Crashed any run of these flows that sent nothing for ``within_seconds`` after a heartbeat."""
    return Automation(
        name=HEARTBEAT_LOST,
        description="A training flow run whose heartbeats stopped (its machine died) is marked Crashed, so that "
        f"'{RESTART_CRASHED}' can restart it.",
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={"prefect.flow-run.heartbeat"},
            expect=ALIVE_OR_DONE,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "flow",
                "prefect.resource.id": [f"prefect.flow.{i}" for i in flow_ids],
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


def restart_crashed(deployment_ids: list[UUID], debounce_seconds: float = RESTART_DEBOUNCE_SECONDS) -> Automation:
    """Moves a Crashed run of these deployments back to Scheduled, named AwaitingRestart: once per run within
    ``debounce_seconds`` (a second report of the same death is ignored)."""
    return Automation(
        name=RESTART_CRASHED,
        description="A Crashed flow run of a training deployment is rescheduled; it resumes from its last "
        "checkpoint, and ends Failed past its max_restarts.",
        trigger=EventTrigger(
            posture=Posture.Reactive,
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "deployment",
                "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids],
            },
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=debounce_seconds),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED,
                name="AwaitingRestart",
                message="restarted after a crash by the training deployment's automation",
            )
        ],
    )


# After a Crashed report of attempt N (events labelled prefect.run-count=N), what shows that attempt N was
# restarted, is alive after all (the report was a late duplicate), or ended. State events are named after the state:
# AwaitingRestart and Preempted are Scheduled states. training.attempt.alive comes from flows/restarts.py.
RESTARTED_OR_ALIVE = {
    "training.attempt.alive",
    *(f"prefect.flow-run.{name}" for name in ("AwaitingRestart", "Preempted", "Completed", "Failed", "Cancelled",
                                              "Cancelling")),
}  # fmt: skip


def restart_missed(deployment_ids: list[UUID], within_seconds: float) -> Automation:
    """Reschedules a Crashed run of these deployments that nothing restarted within ``within_seconds``: a second
    crash inside the restart's debounce window. Bucketed by attempt (``prefect.run-count``): Prefect keeps one bucket
    per key, and the first crash's bucket, already answered by its restart, would swallow the second crash."""
    return Automation(
        name=RESTART_MISSED,
        description=f"A Crashed training run that '{RESTART_CRASHED}' left alone (a second crash soon after the first) "
        "is rescheduled once nothing else happened to it for a while.",
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={"prefect.flow-run.Crashed"},
            expect=RESTARTED_OR_ALIVE,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "deployment",
                "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids],
            },
            for_each={"prefect.resource.id", "prefect.run-count"},
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED,
                name="AwaitingRestart",
                message=f"restarted after a crash that no restart followed for {within_seconds:.0f}s",
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
    """Creates or updates both automations for these deployments (``flow/deployment`` names)."""
    with get_client(sync_client=True) as client:
        deployments = [client.read_deployment_by_name(name) for name in deployment_names]
        ids = [d.id for d in deployments]
        flow_ids = sorted({d.flow_id for d in deployments}, key=str)
        frequency = heartbeat_seconds(client, ids)
    within = within_seconds if within_seconds is not None else 3 * frequency
    if within <= frequency:
        raise ValueError(
            f"within={within}s: must exceed the heartbeat frequency ({frequency}s), or every "
            f"healthy run would be marked Crashed; use about 3x the frequency"
        )
    if within <= RESTART_DEBOUNCE_SECONDS:
        raise ValueError(
            f"within={within}s: must exceed the restart's debounce ({RESTART_DEBOUNCE_SECONDS:g}s), or a second crash "
            f"inside it would never be reported again"
        )
    return [upsert(heartbeat_lost(flow_ids, within)), upsert(restart_crashed(ids)), upsert(restart_missed(ids, within))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.automations", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--deployment",
        action="append",
        dest="deployments",
        help=f"flow/deployment to restart after crashes (repeatable; default: {DEFAULT_DEPLOYMENTS})",
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
