"""A deployment run on a real Prefect server and process worker, preempted by a real SIGTERM, and one SIGKILLed.

A polite termination of the flow-run process (what a reclaimed spot machine or an evicted pod sends) commits a
checkpoint at the current step, and the run reschedules itself (``Preempted``, a Scheduled state): the worker
runs the same flow run again, which resumes at that step; its state history never shows Failed or Crashed, the
unit task it stopped ends Preempted (not Crashed, as Prefect shows an exception that is not an Exception), and
the final weights are torch.equal to an uninterrupted deployment run's. (A SIGKILL, restarted exactly once and never
Failed, with `deployments.outcome` waiting through its Crashed: test_deployments.py's killed flow-run test.)

Machines rarely stop with one signal: a second SIGTERM 0.1 s later and a storm of them until the process is gone
change nothing of that (never Crashed); a machine shutting down (SIGTERM to the worker and to the flow-run process
at once) leaves the run Scheduled "Preempted" with its checkpoint at the step, past the heartbeat window with the stack's reconciler watching,
and the next worker completes it bit-identically.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prefect.client.schemas.objects import StateType

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from deployments import stack as stacks
from tests.integration.conftest import HEARTBEAT_WITHIN_SECONDS
from tests.integration.stack_client import (
    ROOT,
    SYNTHETIC,
    flow_run_process,
    logs_containing,
    read_run,
    start_run,
    state_names,
    task_run_states,
    wait_for,
    wait_for_state,
)
from tests.procs import alive

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(900)]
PACED = "tests.recipes_for_tests:PacedRecipe"
STEPS = 16


def paced(folder: Path, run_name: str, record: Path) -> dict:
    args = {"num_samples": 256, "hidden": 256, "record_dir": str(record), "step_seconds": 0.15}
    return {**SYNTHETIC, "run_name": run_name, "save_folder": str(folder), "recipe": PACED, "recipe_args": args,
            "max_duration": f"{STEPS}ba", "save_interval": "4ba"}  # fmt: skip


def model_of(folder: Path, run_name: str) -> dict[str, torch.Tensor]:
    store = CheckpointStore(str(folder), run_name)
    info = store.latest(deep=True)
    assert info is not None, f"no good checkpoint of {run_name} in {folder}"
    return store.load(info, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]


def batches(record: Path) -> int:
    """Batches rank 0 has started (the recipe records each batch's sample ids as it starts)."""
    try:
        return len((record / "ids-rank0.txt").read_text().splitlines())
    except OSError:
        return 0


def in_a_step(record: Path) -> bool:
    try:
        return (record / "phase").read_text().startswith("step")
    except OSError:
        return False


def uninterrupted(prefect_stack, folder: Path) -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted run of the paced recipe, trained by ``python -m tests.run_lifecycle`` (the
    train flow's lifecycle without Prefect) in a process like a flow run's: the stack's environment and the OpenMP
    threads the worker gives its flow runs. The reference is only weights to compare against, and the same config
    trains the same weights either way (checked once against a deployment run, torch.equal); a deployment run of its
    own cost this module a flow run through the worker (issue 47)."""
    config = paced(folder / "runs", "ref", folder / "ids")
    flags = [
        f for key, value in config.items() for f in (f"--{key}", value if isinstance(value, str) else json.dumps(value))
    ]
    env = prefect_stack.stack.env(OMP_NUM_THREADS=str(stacks.worker_threads()))
    done = subprocess.run([sys.executable, "-m", "tests.run_lifecycle", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return model_of(folder / "runs", "ref")


@pytest.fixture(scope="module")
def reference(prefect_stack, tmp_path_factory) -> dict[str, torch.Tensor]:
    return uninterrupted(prefect_stack, tmp_path_factory.mktemp("reference"))


def started_mid_unit(prefect_stack, folder: Path, record: Path, run_name: str):
    """A run of the paced recipe, in the first or second of a unit's 4 steps (batches started: 4k+1 or 4k+2) after
    the first unit: (run id, its flow-run process, the unit a stop now lands inside)."""
    run_id = start_run(prefect_stack, "train/default", {"config": paced(folder, run_name, record)})
    wait_for(lambda: (folder / run_name / "latest").exists() and in_a_step(record) and batches(record) % 4 in (1, 2),
             240, "the first steps of a unit after the first")  # fmt: skip
    return run_id, flow_run_process(prefect_stack.worker.pid, run_id), (batches(record) - 1) // 4


def assert_preempted_then_completed_bit_identically(prefect_stack, run_id, folder, record, unit, reference) -> str:
    """The run resumed once from its preemption and completed, never Failed or Crashed; its logs."""
    run = wait_for_state(prefect_stack, run_id, StateType.COMPLETED, timeout=300)
    names = state_names(prefect_stack, run_id)
    assert "Preempted" in names and "Failed" not in names and "Crashed" not in names, names
    assert run.run_count == 2  # the preempted attempt and the one that resumed
    # The unit stopped by the signal ends its task run Preempted (a Cancelled state), not Crashed like a dead process.
    tasks = wait_for(lambda: (t := task_run_states(prefect_stack, run_id)) and any(n == "Preempted" for *_, n in t) and t,
                     30, "the preempted unit's task run state")  # fmt: skip
    assert (f"p-unit-{unit}", "CANCELLED", "Preempted") in tasks, tasks
    assert not [t for t in tasks if t[1] in ("CRASHED", "FAILED")], tasks
    logs = logs_containing(prefect_stack, run_id, "preempted by SIGTERM: stopped at step", "the restart will resume")
    assert "starting from checkpoint" in logs
    assert len((record / "ids-rank0.txt").read_text().splitlines()) == STEPS  # no step trained twice
    assert CheckpointStore(str(folder), "p").fence.newest() == 2  # two attempts, one after the other
    got = model_of(folder, "p")
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    return logs


def ignored_signals(prefect_stack) -> int:
    """How many signals the flow-run processes said they ignored (on their stderr, which the worker logs)."""
    said = "SIGTERM ignored: this process is already stopping"
    return sum(log.read_text(errors="replace").count(said) for log in prefect_stack.logs.glob("worker-*.log"))


def test_sigterm_reschedules_the_run_itself_a_second_one_and_a_storm_change_nothing_it_completes_bit_identically(
    prefect_stack, tmp_path, reference
):
    """The first SIGTERM is the preemption (the run reschedules itself and resumes at the step, never Failed or
    Crashed); the ones after it are what machines send besides (this test carries both scenarios since issue 47:
    a lone SIGTERM is this test's first signal, and every assertion of its own test is the first line below)."""
    folder, record = tmp_path / "runs", tmp_path / "ids"
    run_id, victim, unit = started_mid_unit(prefect_stack, folder, record, "p")
    before = ignored_signals(prefect_stack)

    os.kill(victim, signal.SIGTERM)
    # An operator's second `kill`, `docker stop` after a `kill`, Slurm signalling step and shell: soon after the first,
    # while the process is still stopping (a stop can take under a second; a signal during the interpreter's own exit
    # is ignored by SIG_IGN, and says nothing).
    time.sleep(0.1)
    sent = 1
    while alive(victim):  # ... then a storm, until the process is gone: every phase of its exit gets some
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGTERM)
            sent += 1
        time.sleep(0.05)

    assert_preempted_then_completed_bit_identically(prefect_stack, run_id, folder, record, unit, reference)
    assert sent >= 2 and ignored_signals(prefect_stack) - before >= 1  # the process said so on its stderr


def test_a_machine_shutdown_stopping_worker_and_flow_run_together_leaves_the_run_preempted_with_its_checkpoint(
    prefect_stack, tmp_path, reference
):
    folder, record = tmp_path / "runs", tmp_path / "ids"
    run_id, victim, unit = started_mid_unit(prefect_stack, folder, record, "p")
    worker = prefect_stack.worker

    os.kill(worker.pid, signal.SIGTERM)  # one SIGTERM to every process of the machine, at once
    os.kill(victim, signal.SIGTERM)

    assert worker.wait(timeout=90) == 0  # the worker let the preemption finish, then stopped
    run = wait_for(
        lambda: (r := read_run(prefect_stack, run_id)).state is not None and r.state.name == "Preempted" and r,
        30,
        "Preempted",
    )
    assert run.state.type == StateType.SCHEDULED, run.state
    info = CheckpointStore(str(folder), "p").latest(deep=True)
    assert info is not None
    assert info.progress["step"] == batches(record) and info.progress["step"] % 4 != 0  # at the step, in the unit
    # No worker, no heartbeat: the stack's reconciler (on a machine still up) must not call it a crash
    reconciler = stacks.start_recovery(prefect_stack.stack, tmp_path / "recovery.log")
    try:
        time.sleep(HEARTBEAT_WITHIN_SECONDS + 15)
        assert reconciler.poll() is None, (tmp_path / "recovery.log").read_text()
    finally:
        stacks.stop(reconciler)
    run = read_run(prefect_stack, run_id)
    assert run.state is not None
    assert (run.state.type, run.state.name) == (StateType.SCHEDULED, "Preempted"), run.state
    assert "Crashed" not in state_names(prefect_stack, run_id)

    prefect_stack.start_worker()  # the machine is back

    assert_preempted_then_completed_bit_identically(prefect_stack, run_id, folder, record, unit, reference)
