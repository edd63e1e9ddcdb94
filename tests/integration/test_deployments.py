"""The deployments, end to end on a real Prefect server and process worker, with real signals.

Proves what the product promises for deployments: prefect.yaml's nightly schedule creates runs; the
automations install idempotently; `prefect deployment run` completes with checkpoints and artifacts; a
flow-run process killed mid-unit comes back as the same flow run and resumes from its last checkpoint; a
run that keeps dying stops at max_restarts as Failed; scheduled retraining warm-starts from the released
model and promotes only models that are not worse; and a whole dead machine (worker and run, nobody left
to report) is noticed by its missing heartbeats and restarted on another worker. One server and worker
serve the module (tests/integration/conftest.py); its logs are in the pytest tmp dir (stack-logs*).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.states import Scheduled

from checkpointing import CheckpointStore
from deployments.automations import DEFAULT_DEPLOYMENTS, HEARTBEAT_LOST, RESTART_CRASHED
from deployments.stack import descendants, install_automations
from tests.conftest import ROOT
from tests.integration.conftest import HEARTBEAT_WITHIN_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

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
    return UUID(re.search(r"UUID: ([0-9a-f-]{36})", output).group(1))


def start_run(stack, deployment: str, parameters: dict, scheduled: datetime | None = None) -> UUID:
    with client(stack) as c:
        dep = c.read_deployment_by_name(deployment)
        state = Scheduled(scheduled_time=scheduled) if scheduled else None
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
        if run.state.type in other_ends:
            raise AssertionError(f"flow run {run_id} ended {run.state.name}: {run.state.message}")
        return run if run.state.type == state else None

    return wait_for(reached, timeout, f"flow run {run_id} to be {state.value}")


def state_names(stack, run_id: UUID) -> list[str]:
    with client(stack) as c:
        return [s.name for s in c.read_flow_run_states(run_id)]


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
    with client(stack) as c:
        return {name: c.read_automations_by_name(name) for name in (HEARTBEAT_LOST, RESTART_CRASHED)}


# -- tests ----------------------------------------------------------------------------------------
def test_nightly_schedule_from_prefect_yaml_creates_runs_at_three_utc(prefect_stack):
    with client(prefect_stack) as c:
        deployment = c.read_deployment_by_name("retrain/nightly")

    runs = wait_for(lambda: scheduled_runs(prefect_stack, deployment.id), 120, "the scheduler to create nightly runs")

    starts = [r.expected_start_time.astimezone(UTC) for r in runs]
    assert all((t.hour, t.minute) == (3, 0) for t in starts), starts
    assert len({t.date() for t in starts}) == len(starts)  # one a night
    assert runs[0].parameters["run_prefix"] == "nightly" and runs[0].parameters["config"] == {"max_duration": "3ep"}
    # This stack must never run the real nightly job: pausing the schedule removes its future runs.
    schedule_id = str(deployment.schedules[0].id)
    proc = prefect_cli(prefect_stack, "deployment", "schedule", "pause", "retrain/nightly", schedule_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wait_for(lambda: not scheduled_runs(prefect_stack, deployment.id), 60, "the paused schedule's runs to go")


def test_installing_the_automations_again_updates_them_in_place(prefect_stack):
    before = read_automations(prefect_stack)
    install_automations(prefect_stack.stack, "--within", "75")
    try:
        after = read_automations(prefect_stack)
        with client(prefect_stack) as c:
            deployment_ids = {f"prefect.deployment.{c.read_deployment_by_name(n).id}" for n in DEFAULT_DEPLOYMENTS}
    finally:
        install_automations(prefect_stack.stack, "--within", str(HEARTBEAT_WITHIN_SECONDS))

    assert {n: [a.id for a in found] for n, found in after.items()} == {
        n: [a.id for a in found] for n, found in before.items()
    }  # one of each, the same objects
    assert after[HEARTBEAT_LOST][0].trigger.within == timedelta(seconds=75)
    assert set(after[RESTART_CRASHED][0].trigger.match_related.root["prefect.resource.id"]) == deployment_ids


def test_deployment_run_from_the_cli_completes_with_checkpoints_and_artifacts(prefect_stack, tmp_path):
    config = {
        **SYNTHETIC,
        "run_name": "cli-run",
        "save_folder": str(tmp_path / "runs"),
        "recipe_args": {"num_samples": 256},
    }

    proc = prefect_cli(
        prefect_stack,
        "deployment",
        "run",
        "train/default",
        "--params",
        json.dumps({"config": config}),
        "--watch",
        "--watch-timeout",
        "240",
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = read_run(prefect_stack, run_id_from(proc.stdout))
    assert run.state.type == StateType.COMPLETED and run.deployment_id is not None
    assert sorted(checkpoints(tmp_path / "runs", "cli-run")) == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    table = json.loads(artifact(prefect_stack, "train-cli-run-checkpoints").data)
    assert [row["name"] for row in table] == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    assert all(row["verified"] and row["seconds_to_save"] is not None for row in table)
    assert artifact(prefect_stack, "train-cli-run-progress").data == 100.0
    summary = artifact(prefect_stack, "train-cli-run-summary").data
    assert "loss.svg" in summary and "| accuracy |" in summary
    assert (tmp_path / "runs" / "cli-run" / "loss.svg").read_text().startswith("<svg")


def test_killed_flow_run_process_is_restarted_as_the_same_run_and_resumes(prefect_stack, tmp_path):
    folder, markers = tmp_path / "runs", tmp_path / "markers"
    run_id = start_run(prefect_stack, "train/default", {"config": pause_config(folder, "killed", markers)})
    paused_pid = int(
        wait_for(
            lambda: (markers / "paused").exists() and (markers / "paused").read_text(), 240, "the run to reach unit 1"
        )
    )

    victim = flow_run_process(prefect_stack.worker.pid, run_id)
    assert victim == paused_pid  # the worker's child for this run is the process that trains it
    assert list(checkpoints(folder, "killed")) == ["ep1-ba8-sa256"]
    os.kill(victim, signal.SIGKILL)

    run = wait_for_state(prefect_stack, run_id, StateType.COMPLETED)
    assert run.id == run_id and run.run_count >= 2
    names = state_names(prefect_stack, run_id)
    assert "Crashed" in names and "AwaitingRestart" in names
    saved = checkpoints(folder, "killed")
    assert sorted(saved) == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    # ep1 is still the killed process's; the restarted process resumed from it rather than starting over.
    assert saved["ep1-ba8-sa256"].manifest.writer.pid == victim
    assert saved["ep2-ba16-sa512"].manifest.writer.pid != victim
    logs_containing(prefect_stack, run_id, "unit 1 (attempt 1): starting from checkpoint ep1-ba8-sa256 at epoch 1")


def test_run_that_keeps_dying_stops_at_max_restarts_as_failed(prefect_stack, tmp_path):
    markers = tmp_path / "markers"
    config = {
        **SYNTHETIC,
        "run_name": "doomed",
        "save_folder": str(tmp_path / "runs"),
        "max_restarts": 1,
        "recipe": "tests.integration.deploy_recipes:DyingRecipe",
        "recipe_args": {"num_samples": 256, "marker_dir": str(markers)},
    }

    # `-p key=<JSON>` is parsed as JSON by the Prefect 3.8 CLI, the same as --params.
    proc = prefect_cli(prefect_stack, "deployment", "run", "train/default", "-p", f"config={json.dumps(config)}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = run_id_from(proc.stdout)

    run = wait_for_state(prefect_stack, run_id, StateType.FAILED, timeout=300)
    assert run.run_count >= 3  # the first attempt, one restart, and the attempt that refused to go on
    assert "max_restarts=1" in run.state.message
    assert len((markers / "deaths").read_text().split()) == 2  # two processes died; the third did not train
    assert state_names(prefect_stack, run_id).count("AwaitingRestart") >= 2


def test_retraining_warm_starts_from_the_release_and_promotes_only_models_not_worse(prefect_stack, tmp_path):
    folder = tmp_path / "runs"
    release = folder / "release.json"

    def tick(day: int, **recipe_args) -> dict:
        config = {
            "recipe": "recipes.digits:DigitsRecipe",
            "recipe_args": recipe_args,
            "max_duration": "1ep",
            "global_batch_size": 64,
            "save_folder": str(folder),
            "unit_retries": 0,
        }
        scheduled = datetime(2026, 1, day, 3, 0, tzinfo=UTC)
        run_id = start_run(prefect_stack, "retrain/nightly", {"config": config, "run_prefix": "tick"}, scheduled)
        wait_for_state(prefect_stack, run_id, StateType.COMPLETED)
        logs = logs_containing(prefect_stack, run_id, "unit 0 (attempt 1): starting from", "retrain decision:")
        return {"logs": logs, "release": json.loads(release.read_text())}

    first = tick(1)
    assert first["release"]["run_name"] == "tick-20260101T0300"  # named after the scheduled time
    assert "starting from fresh initialization" in first["logs"]

    second = tick(2)
    assert f"starting from weights of {first['release']['checkpoint']} (load_path)" in second["logs"]
    assert second["release"]["run_name"] == "tick-20260102T0300"
    assert second["release"]["value"] >= first["release"]["value"]

    before = release.read_bytes()
    third = tick(3, lr=1.0)  # a learning rate that wrecks the model
    assert f"starting from weights of {second['release']['checkpoint']} (load_path)" in third["logs"]
    assert "kept the release tick-20260102T0300" in third["logs"]
    assert release.read_bytes() == before


def test_dead_machine_is_detected_by_missing_heartbeats_and_restarted_on_another_worker(prefect_stack, tmp_path):
    folder, markers = tmp_path / "runs", tmp_path / "markers"
    run_id = start_run(prefect_stack, "train/default", {"config": pause_config(folder, "machine", markers)})
    wait_for(lambda: (markers / "paused").exists(), 240, "the run to reach unit 1")

    prefect_stack.kill_worker_machine()  # worker and flow run die together: nobody reports a crash
    assert read_run(prefect_stack, run_id).state.type == StateType.RUNNING
    prefect_stack.start_worker()  # another machine

    run = wait_for_state(prefect_stack, run_id, StateType.COMPLETED, timeout=300)
    assert run.run_count == 2
    with client(prefect_stack) as c:
        crashed = [s for s in c.read_flow_run_states(run_id) if s.type == StateType.CRASHED]
    assert crashed and "no heartbeat" in crashed[0].message  # marked by the heartbeat automation
    assert sorted(checkpoints(folder, "machine")) == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    logs_containing(prefect_stack, run_id, "unit 1 (attempt 1): starting from checkpoint ep1-ba8-sa256 at epoch 1")


def test_a_run_parameter_cannot_choose_code_or_storage_options(prefect_stack, tmp_path):
    """Anyone who may create a flow run sets its parameters through the API: they must not import a module,
    call a class that is not an allowed recipe, or choose the storage endpoint."""
    marker = tmp_path / "evil-marker"
    base = {**SYNTHETIC, "save_folder": str(tmp_path / "runs"), "recipe_args": {"num_samples": 64}}
    attacks = {
        "module": {**base, "run_name": "a1", "recipe": "tests.evil_recipe:NotARecipe",
                   "recipe_args": {"path": str(marker)}},
        "os.system": {**base, "run_name": "a2", "recipe": "os:system",
                      "recipe_args": {"command": f"touch {marker}"}},
        "storage": {**base, "run_name": "a3",
                    "storage_options": {"client_kwargs": {"endpoint_url": "http://169.254.169.254"}}},
    }  # fmt: skip
    runs = {name: start_run(prefect_stack, "train/default", {"config": config}) for name, config in attacks.items()}

    ended = {name: wait_for_state(prefect_stack, run_id, StateType.FAILED) for name, run_id in runs.items()}

    assert "recipe='tests.evil_recipe:NotARecipe' is not allowed on this worker" in ended["module"].state.message
    assert "recipe='os:system' is not allowed on this worker" in ended["os.system"].state.message
    assert "storage_options cannot be set through a flow-run parameter" in ended["storage"].state.message
    assert not marker.exists()
    assert not (prefect_stack.logs / "evil-module-was-imported").exists()  # not even imported
    assert not (tmp_path / "runs").exists()  # refused before anything was written
