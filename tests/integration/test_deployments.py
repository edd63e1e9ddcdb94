"""The deployments, end to end on a real Prefect server and process worker, with real signals.

Proves what the product promises for deployments: prefect.yaml's nightly schedule creates runs; the
install leaves no automation and one heartbeat window; `prefect deployment run` completes with checkpoints and artifacts; a
flow-run process killed mid-unit comes back as the same flow run exactly once, never Failed, and resumes from its
last checkpoint, while `deployments.outcome` waits through the Crashed to Completed; a
run that keeps dying stops at max_restarts as Failed; scheduled retraining warm-starts from the released
model and promotes only models that are not worse, gives two ticks in one minute runs of their own, and
resumes a killed tick under its own name; a whole dead machine (worker and run, nobody left to report)
is noticed by its missing heartbeats and restarted on another worker, while a flow run outside a deployment,
silent as long, is never marked; and a link planted in, or swapped into,
the worker's allowed roots fails a run in one line with nothing read or written outside, as does data outside them
or a data endpoint of the run's own. One server and worker
serve the module, shared with this pytest process's other system modules on SQLite (tests/integration/conftest.py);
its logs are in the pytest tmp dir (stack-logs*).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID, uuid4

import pytest
from prefect.automations import AutomationCore, ChangeFlowRunState, EventTrigger, Posture
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
from prefect.client.schemas.objects import StateType

from checkpointing import CheckpointStore
from deployments.automations import DEFAULT_DEPLOYMENTS, HEARTBEAT_LOST, OBSOLETE, WINDOW_VARIABLE, window_seconds
from deployments.stack import install_automations, worker_threads
from tests.integration.conftest import HEARTBEAT_WITHIN_SECONDS
from tests.integration.stack_client import (
    ROOT,
    SYNTHETIC,
    alive_attempts,
    artifact,
    checkpoints,
    client,
    flow_run_process,
    logs_containing,
    logs_of,
    pause_config,
    prefect_cli,
    read_automations,
    read_run,
    run_id_from,
    scheduled_runs,
    start_run,
    state_names,
    story,
    task_run_states,
    wait_for,
    wait_for_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(900)]


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


def test_installing_again_removes_old_automations_and_stores_one_window(prefect_stack):
    """No automation decides a run's fate (deployments/automations.py): installing deletes those an older install
    left, the heartbeat-lost one included, and stores the window every reconciler of the server reads."""
    with client(prefect_stack) as c:
        found = c.read_deployment_by_name(DEFAULT_DEPLOYMENTS[0])
        c.create_automation(
            AutomationCore(  # what the install before this one left on the server: the heartbeat rule
                name=HEARTBEAT_LOST,
                trigger=EventTrigger(
                    posture=Posture.Proactive, after={"prefect.flow-run.heartbeat"},
                    expect={"prefect.flow-run.heartbeat"}, match={"prefect.resource.id": "prefect.flow-run.*"},
                    for_each={"prefect.resource.id"}, within=timedelta(seconds=60),
                ),
                actions=[ChangeFlowRunState(state=StateType.CRASHED)],
            )
        )  # fmt: skip
    assert read_automations(prefect_stack)[HEARTBEAT_LOST]
    install_automations(prefect_stack.stack, "--within", "75")
    try:
        after = read_automations(prefect_stack)
        with client(prefect_stack) as c:
            window = window_seconds(c, [found])
        refused = subprocess.run(
            [sys.executable, "-m", "deployments.automations", "--within", "20"],
            env=prefect_stack.env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        kept = read_automations(prefect_stack)[WINDOW_VARIABLE]
    finally:
        install_automations(prefect_stack.stack, "--within", str(HEARTBEAT_WITHIN_SECONDS))

    assert all(after[name] == [] for name in OBSOLETE), after  # nothing acts on events as they were
    assert after[WINDOW_VARIABLE] == 75 and window == 75.0  # what a reconciler of this server counts silence by
    assert refused.returncode == 2 and kept == 75, (refused.returncode, kept)  # a window a heartbeat long: refused
    [line] = refused.stderr.strip().splitlines()
    assert "--within 20" in line and "heartbeat frequency (30s)" in line, line


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
    assert "loss.svg" in summary and "| eval\\_accuracy |" in summary
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
    # it trains with the worker's thread count (torch's default, one per core, collapses next to the server)
    assert int((markers / "threads").read_text()) == worker_threads()
    # and it was not given the server's database settings (its password, on PostgreSQL)
    assert b"PREFECT_SERVER_DATABASE" not in Path(f"/proc/{victim}/environ").read_bytes()
    assert list(checkpoints(folder, "killed")) == ["ep1-ba8-sa256"]
    os.kill(victim, signal.SIGKILL)

    # How a user of `prefect deployment run` waits for the real outcome: Crashed on the way is not it.
    waited = subprocess.run([sys.executable, "-m", "deployments.outcome", str(run_id), "--timeout", "400"],
                            cwd=ROOT, env=prefect_stack.env(), capture_output=True, text=True, timeout=460)  # fmt: skip
    assert waited.returncode == 0 and waited.stdout.startswith(f"flow run {run_id}: Completed"), waited
    run = read_run(prefect_stack, run_id)
    assert run.id == run_id and run.run_count >= 2
    names = state_names(prefect_stack, run_id)
    # one death: one Crashed (the worker's late report of the same exit is not sent), one restart, then Completed;
    # never Failed on the way
    assert names.count("Crashed") == 1 and names.count("AwaitingRestart") == 1 and "Failed" not in names, names
    assert run.run_count == 2 and names[-1] == "Completed", names
    assert CheckpointStore(str(folder), "killed").fence.newest() == 2  # exactly one new attempt claimed the run
    saved = checkpoints(folder, "killed")
    assert sorted(saved) == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    # ep1 is still the killed process's; the restarted process resumed from it rather than starting over.
    assert saved["ep1-ba8-sa256"].manifest.writer.pid == victim
    assert saved["ep2-ba16-sa512"].manifest.writer.pid != victim
    logs_containing(prefect_stack, run_id, "unit 1 (attempt 1): starting from checkpoint ep1-ba8-sa256 at epoch 1")
    # What the UI shows is true: the killed attempt's unit task run ended Crashed "AttemptDied" when the restart took
    # over (it stayed Running forever), and no task run of the Completed flow run is left unfinished.
    tasks = task_run_states(prefect_stack, run_id)
    assert all(kind in ("COMPLETED", "CRASHED") for _, kind, _ in tasks), tasks
    assert [name for name, kind, state in tasks if kind == "CRASHED"] == ["killed-unit-1"], tasks
    assert [state for _, kind, state in tasks if kind == "CRASHED"] == ["AttemptDied"], tasks
    # The summary says how long the run took across its attempts; Prefect's Duration leaves out the restart's gap.
    summary = artifact(prefect_stack, "train-killed-summary").data
    wall = re.search(r"wall time since the flow run first started: (\d+) s .*, over (\d+) attempts", summary)
    took = (run.end_time - run.start_time).total_seconds()
    assert wall and took - 5 <= int(wall[1]) <= took + 1 and int(wall[2]) == run.run_count, (summary, took)
    assert run.total_run_time.total_seconds() < took - 2, (run.total_run_time, took)


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
        return {"logs": logs, "release": json.loads(release.read_text()), "id": str(run_id)}

    first = tick(1)
    # named after the scheduled time and its own flow run
    assert first["release"]["run_name"] == f"tick-20260101T0300-{first['id'][:8]}"
    assert "starting from fresh initialization" in first["logs"]

    second = tick(1)  # another tick in the same minute (two manual runs): a run of its own, from the first's model
    assert second["release"]["run_name"] == f"tick-20260101T0300-{second['id'][:8]}" != first["release"]["run_name"]
    assert f"starting from weights of {first['release']['checkpoint']} (load_path)" in second["logs"]
    assert second["release"]["value"] >= first["release"]["value"]

    before = release.read_bytes()
    third = tick(3, lr=1.0)  # a learning rate that wrecks the model
    assert f"starting from weights of {second['release']['checkpoint']} (load_path)" in third["logs"]
    assert f"kept the release {second['release']['run_name']}" in third["logs"]
    assert release.read_bytes() == before


def test_a_killed_tick_is_restarted_under_its_own_name_and_resumes_its_own_checkpoints(prefect_stack, tmp_path):
    folder, markers = tmp_path / "runs", tmp_path / "markers"
    config = {k: v for k, v in pause_config(folder, "unused", markers).items() if k != "run_name"}  # the tick names it
    scheduled = datetime(2026, 2, 1, 3, 0, tzinfo=UTC)
    run_id = start_run(prefect_stack, "retrain/nightly", {"config": config, "run_prefix": "tick"}, scheduled)
    wait_for(lambda: (markers / "paused").exists(), 240, "the tick to reach unit 1")
    name = f"tick-20260201T0300-{str(run_id)[:8]}"
    assert list(checkpoints(folder, name)) == ["ep1-ba8-sa256"]

    victim = flow_run_process(prefect_stack.worker.pid, run_id)
    os.kill(victim, signal.SIGKILL)

    run = wait_for_state(prefect_stack, run_id, StateType.COMPLETED)
    assert run.run_count >= 2 and "AwaitingRestart" in state_names(prefect_stack, run_id)
    # the restarted tick kept its name: one run folder, whose ep1 the killed process wrote and the rest the new one
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [name]
    saved = checkpoints(folder, name)
    assert sorted(saved) == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    assert saved["ep1-ba8-sa256"].manifest.writer.pid == victim != saved["ep2-ba16-sa512"].manifest.writer.pid
    assert json.loads((folder / "release.json").read_text())["run_name"] == name
    logs_containing(prefect_stack, run_id, "unit 1 (attempt 1): starting from checkpoint ep1-ba8-sa256 at epoch 1")
    # the killed attempt's train subflow and its unit ended Crashed "AttemptDied"; nothing of the tick stays unfinished
    with client(prefect_stack) as c:
        children = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id]))
        )
    assert sorted((r.state.type.value, r.state.name) for r in children) == [
        ("COMPLETED", "Completed"),
        ("CRASHED", "AttemptDied"),
    ], f"{story(prefect_stack, run_id)}\n{logs_of(prefect_stack, run_id)[-6000:]}"
    # each attempt said it was alive as the deployment run, the one the reconciler watches (a late report or a late
    # heartbeat over a live attempt is then no death), never as its train subflow, whose id nobody watches
    ids = [run_id, *(r.id for r in children)]
    deadline = time.monotonic() + 60  # events are stored a few seconds after they are sent
    while (beats := alive_attempts(prefect_stack, ids))[str(run_id)] < {"1", "2"} and time.monotonic() < deadline:
        time.sleep(1)
    assert beats == {str(run_id): beats[str(run_id)] | {"1", "2"}} | {str(r.id): set() for r in children}, beats
    tasks = [t for r in (run_id, *(r.id for r in children)) for t in task_run_states(prefect_stack, r)]
    assert all(kind in ("COMPLETED", "CRASHED") for _, kind, _ in tasks), tasks
    assert f"{name}-unit-1" in [task for task, kind, state in tasks if (kind, state) == ("CRASHED", "AttemptDied")]


def test_dead_machine_is_detected_by_missing_heartbeats_and_restarted_on_another_worker(prefect_stack, tmp_path):
    """A whole dead machine (worker and run) is marked Crashed by the reconciler of the worker that replaces it (the
    one liveness authority: no automation) once its heartbeats stop for the window, and restarted there.

    The same silence carries issue 44, item 3: every `python -m flows.sweep` flow run longer than the heartbeat window
    against a stack's server was marked `Crashed: no heartbeat` while alive. The reconciler
    watches deployment runs only: a flow run of the sweep flow started from the CLI, which sent a heartbeat before the
    deployment run started and then none for twice the window, stays Running, while the reconciler marks the dead
    deployment run Crashed inside that time."""
    folder, markers = tmp_path / "runs", tmp_path / "markers"
    with client(prefect_stack) as c:
        cli_run = cli_run_with_one_heartbeat(c)
    silent_until = time.monotonic() + 2 * HEARTBEAT_WITHIN_SECONDS
    run_id = start_run(prefect_stack, "train/default", {"config": pause_config(folder, "machine", markers)})
    wait_for(lambda: (markers / "paused").exists(), 240, "the run to reach unit 1")

    prefect_stack.kill_worker_machine()  # worker and flow run die together: nobody reports a crash
    assert read_run(prefect_stack, run_id).state.type == StateType.RUNNING
    prefect_stack.start_worker()  # another machine

    run = wait_for_state(prefect_stack, run_id, StateType.COMPLETED, timeout=300)
    assert run.run_count == 2
    with client(prefect_stack) as c:
        crashed = [s for s in c.read_flow_run_states(run_id) if s.type == StateType.CRASHED]
    assert crashed and "no heartbeat" in crashed[0].message and "recovery sweep" in crashed[0].message  # the reconciler
    assert sorted(checkpoints(folder, "machine")) == ["ep1-ba8-sa256", "ep2-ba16-sa512", "ep3-ba24-sa768"]
    logs_containing(prefect_stack, run_id, "unit 1 (attempt 1): starting from checkpoint ep1-ba8-sa256 at epoch 1")

    with client(prefect_stack) as c:  # the CLI run, silent as long as the dead run and more: twice the window
        while True:
            state = c.read_flow_run(cli_run).state
            assert state.type == StateType.RUNNING, f"{state.type.value}: {state.message}"
            if time.monotonic() > silent_until:
                break
            time.sleep(2)


def cli_run_with_one_heartbeat(c) -> UUID:
    """A Running flow run of the sweep flow with no deployment (what a CLI sweep creates) and one heartbeat event."""
    from prefect.states import Running

    from flows.sweep import sweep

    run = c.create_flow_run(sweep, name="cli-sweep", parameters={})
    c.set_flow_run_state(run.id, Running(), force=True)
    beat = {
        "id": str(uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "prefect.flow-run.heartbeat",
        "resource": {"prefect.resource.id": f"prefect.flow-run.{run.id}"},
        "related": [{"prefect.resource.id": f"prefect.flow.{run.flow_id}", "prefect.resource.role": "flow"}],
    }
    c.request("POST", "/events", json=[beat]).raise_for_status()
    return run.id


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


def test_links_in_or_swapped_into_allowed_folders_fail_a_deployment_run_in_one_line(prefect_stack, tmp_path):
    """The worker's TRAIN_ALLOWED_ROOTS (this session's tmp folders) hold at the moment of each use: an allowed Hugging
    Face folder whose model.safetensors links to another team's weights is never read, and a save folder swapped for
    a link between units gets no further checkpoint. Each run fails in one line, not retried; nothing lands outside."""
    import safetensors.torch
    import torch

    from recipes.synthetic import SyntheticRecipe

    outside = Path(tempfile.mkdtemp(prefix="other-team-"))  # outside every root of the worker
    try:
        torch.manual_seed(5)
        safetensors.torch.save_file(SyntheticRecipe().build_model().state_dict(), outside / "theirs.safetensors")
        hf, gate = tmp_path / "hf", tmp_path / "gate"
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        os.symlink(outside / "theirs.safetensors", hf / "model.safetensors")
        gate.touch()
        base = {**SYNTHETIC, "unit_retries": 2, "retry_delay_seconds": 0}
        linked = {"save_folder": str(tmp_path / "runs"), "load_path": str(hf), "load_weights_only": True}
        gated = {"recipe": "tests.recipes_for_tests:GatedRecipe", "save_folder": str(tmp_path / "swapped")}
        configs = {
            "linked": {**base, **linked, "run_name": "linked", "recipe_args": {"num_samples": 64}},
            "swapped": {
                **base,
                **gated,
                "run_name": "swapped",
                "recipe_args": {"num_samples": 256, "gate_file": str(gate), "gate_at_step": 10},
            },
        }
        runs = {name: start_run(prefect_stack, "train/default", {"config": config}) for name, config in configs.items()}
        wait_for(lambda: checkpoints(tmp_path / "swapped", "swapped"), 240, "the swapped run's first checkpoint")
        os.rename(tmp_path / "swapped", tmp_path / "swapped-moved")
        os.symlink(outside, tmp_path / "swapped")
        gate.unlink()  # the unit that was held at step 10 goes on, to its checkpoint at step 16

        ended = {name: wait_for_state(prefect_stack, run_id, StateType.FAILED) for name, run_id in runs.items()}

        link_line = "a symbolic link below the allowed root (TRAIN_ALLOWED_ROOTS); a deployment run never reads"
        assert f"load_path={str(hf)!r} (model.safetensors): {link_line}" in ended["linked"].state.message
        swapped_line = f"{tmp_path / 'swapped'} is a symbolic link below the allowed root"
        assert swapped_line in ended["swapped"].state.message
        assert all("\n" not in run.state.message for run in ended.values())
        with client(prefect_stack) as c:
            units = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs["swapped"]])))
        assert [(u.name, u.run_count) for u in units if u.state.is_failed()] == [("swapped-unit-1", 1)]  # no retry
        assert sorted(os.listdir(outside)) == ["theirs.safetensors"]  # nothing written outside the root
        assert not (tmp_path / "runs").exists()  # the linked run claimed and trained nothing
        assert sorted(checkpoints(tmp_path / "swapped-moved", "swapped")) == ["ep1-ba8-sa256"]
    finally:
        shutil.rmtree(outside)


def test_a_deployment_runs_data_lies_under_the_roots_and_its_endpoint_is_the_workers(prefect_stack, tmp_path):
    """Issue 43 on a real worker: a run naming another bucket as its data, or its own endpoint in data_options, fails
    in one line, and an endpoint recording every request hears nothing. The flow-run process holds AWS credentials
    (as a worker does) and AWS_ENDPOINT_URL names the recorder: before the fix the first run listed s3://other/tokens
    there, and the second sent the worker's signed requests to the run's own endpoint."""
    from tests.integration.test_parameter_keys import WORKER_AWS, Listener

    listener = Listener()
    try:
        model = {"vocab_size": 512, "block_size": 8, "n_layer": 1, "n_head": 1, "n_embd": 8}
        base = {"recipe": "gpt", "global_batch_size": 32, "max_duration": "1ep", "save_folder": str(tmp_path / "runs")}
        configs = {
            "outside": {**base, "run_name": "outside", "recipe_args": {**model, "data_url": "s3://other/tokens"}},
            "endpoint": {**base, "run_name": "endpoint", "recipe_args": {
                **model, "data_url": "s3://team/tokens", "data_options": {"endpoint_url": listener.url}}},
        }  # fmt: skip
        env = {**WORKER_AWS, "AWS_ENDPOINT_URL": listener.url}
        with client(prefect_stack) as c:
            deployment = c.read_deployment_by_name("train/default")
            runs = {
                name: c.create_flow_run_from_deployment(
                    deployment.id, parameters={"config": config}, job_variables={"env": env}
                ).id
                for name, config in configs.items()
            }
        ended = {name: wait_for_state(prefect_stack, run_id, StateType.FAILED) for name, run_id in runs.items()}
        outside = "recipe_args.data_url='s3://other/tokens' is outside the locations this worker allows"
        assert outside in ended["outside"].state.message
        options = "recipe_args.data_options.endpoint_url: a deployment run's parameters cannot choose storage options"
        assert options in ended["endpoint"].state.message
        assert listener.seen == [], f"a flow-run process contacted the endpoint: {listener.seen[:5]}"
        assert not (tmp_path / "runs").exists()  # refused before anything was claimed
    finally:
        listener.close()
