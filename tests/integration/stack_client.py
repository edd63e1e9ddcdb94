"""What the deployment tests do to a running stack (tests/integration/conftest.py): start runs, wait for states,
read logs and artifacts, find a run's process. Shared by test_deployments*.py and test_ui.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.states import Scheduled

from checkpointing import CheckpointStore
from deployments.automations import OBSOLETE, WINDOW_VARIABLE
from deployments.stack import descendants
from flows.restarts import ALIVE_EVENT
from tests.conftest import ROOT

SYNTHETIC = {
    "recipe": "recipes.synthetic:SyntheticRecipe",
    "global_batch_size": 32,
    "seed": 7,
    "max_duration": "3ep",
    "save_interval": "1ep",
    "unit_retries": 0,
}
PAUSING = "tests.integration.deploy_recipes:PausingRecipe"


# -- helpers --------------------------------------------------------------------------------------
def client(stack) -> SyncPrefectClient:
    return SyncPrefectClient(stack.api_url)


def prefect_cli(stack, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_id_from(output: str) -> UUID:
    found = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert found is not None, f"no flow run UUID in: {output}"
    return UUID(found.group(1))


def start_run(stack, deployment: str, parameters: dict, scheduled: datetime | None = None) -> UUID:
    with client(stack) as c:
        dep = c.read_deployment_by_name(deployment)
        state: State | None = Scheduled(scheduled_time=scheduled) if scheduled else None
        return c.create_flow_run_from_deployment(dep.id, parameters=parameters, state=state).id


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_run(stack, run_id: UUID) -> FlowRun:
    with client(stack) as c:
        return c.read_flow_run(run_id)


def wait_for_state(stack, run_id: UUID, state: StateType, timeout: float = 240) -> FlowRun:
    other_ends = {StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED} - {state}  # Crashed may be restarted

    def reached():
        run = read_run(stack, run_id)
        assert run.state is not None, f"flow run {run_id} has no state"
        if run.state.type in other_ends:
            raise AssertionError(f"flow run {run_id} ended {run.state.name}: {run.state.message}")
        return run if run.state.type == state else None

    return wait_for(reached, timeout, f"flow run {run_id} to be {state.value}")


def state_names(stack, run_id: UUID) -> list[str | None]:
    with client(stack) as c:
        return [s.name for s in c.read_flow_run_states(run_id)]


def task_run_states(stack, run_id: UUID) -> list[tuple[str, str, str | None]]:
    """(task run name, state type, state name) of every task run of flow run ``run_id``, all its attempts."""
    with client(stack) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return [(r.name, r.state.type.value, r.state.name) for r in runs if r.state is not None]


def story(stack, run_id: UUID) -> str:
    """What happened to a flow run and its subflow runs, for an assertion's message: each run's states in order (time,
    type, name, message) and its parent task run."""
    lines = []
    with client(stack) as c:
        children = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id]))
        )
        for run in [c.read_flow_run(run_id), *children]:
            lines.append(f"flow run {run.name} ({run.id}), parent task run {run.parent_task_run_id}:")
            for s in sorted(c.read_flow_run_states(run.id), key=lambda s: s.timestamp):
                lines.append(f"  {s.timestamp:%H:%M:%S.%f} {s.type.value} {s.name}: {s.message or ''}")
    return "\n".join(lines)


def alive_attempts(stack, run_ids: list[UUID]) -> dict[str, set[str]]:
    """The ``run_count`` labels of the ``training.attempt.alive`` events stored for each of these flow runs (by id)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    wanted = EventFilter(
        event=EventNameFilter(name=[ALIVE_EVENT]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}" for run_id in run_ids]),
    )
    found: dict[str, set[str]] = {str(run_id): set() for run_id in run_ids}
    with client(stack) as c:
        page = c.read_events(filter=wanted, limit=50)  # the API allows no more a page
        while True:
            for event in page.events:
                found[event.resource.id.removeprefix("prefect.flow-run.")].add(event.resource["prefect.run-count"])
            if page.next_page is None:
                return found
            page = c.read_events_page(str(page.next_page))  # what the client does with it


def logs_of(stack, run_id: UUID) -> str:
    """Log text of a flow run and of its subflow runs."""
    with client(stack) as c:
        children = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id]))
        )
        ids = [run_id, *[r.id for r in children]]
        logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
    return "\n".join(log.message for log in logs)


def logs_containing(stack, run_id: UUID, *needles: str, timeout: float = 60) -> str:
    """The run's logs once they contain every needle (a process ships its last logs after its final state)."""
    text = ""

    def found():
        nonlocal text
        text = logs_of(stack, run_id)
        return all(n in text for n in needles)

    try:
        wait_for(found, timeout, f"log lines {needles}")
    except AssertionError:
        raise AssertionError(f"flow run {run_id} never logged {needles}; its logs:\n{text[-4000:]}") from None
    return text


def artifact(stack, key: str):
    with client(stack) as c:
        found = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no artifact {key!r}"
    return found[-1]


def flow_run_process(worker_pid: int, run_id: UUID) -> int:
    """The pid of the worker's child process that executes flow run ``run_id`` (from /proc)."""
    for pid in descendants(worker_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "prefect.engine" in cmdline and f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ:
            return pid
    raise AssertionError(f"no process of worker {worker_pid} runs flow run {run_id}")


def checkpoints(folder: Path, run_name: str) -> dict[str, object]:
    return {info.name: info for info in CheckpointStore(str(folder), run_name).list()}


def pause_config(folder: Path, run_name: str, markers: Path, **overrides) -> dict:
    # 8 batches per epoch: the process stops in unit 1, after checkpoint ep1 was committed.
    args = {"num_samples": 256, "marker_dir": str(markers), "pause_after_batches": 12}
    return {
        **SYNTHETIC,
        "run_name": run_name,
        "save_folder": str(folder),
        "recipe": PAUSING,
        "recipe_args": args,
        **overrides,
    }


def scheduled_runs(stack, deployment_id: UUID) -> list[FlowRun]:
    with client(stack) as c:
        return c.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
            )
        )


def read_automations(stack) -> dict:
    """The automations of the names an older install left (none is installed now), and the heartbeat window."""
    with client(stack) as c:
        variable = c.read_variable_by_name(WINDOW_VARIABLE)
        found = {name: c.read_automations_by_name(name) for name in OBSOLETE}
        return {**found, WINDOW_VARIABLE: None if variable is None else variable.value}
