"""A deployment run on a real Prefect server and process worker, preempted by a real SIGTERM, and one SIGKILLed.

A polite termination of the flow-run process (what a reclaimed spot machine or an evicted pod sends) commits a
checkpoint at the current step, and the run reschedules itself (``Preempted``, a Scheduled state): the worker
runs the same flow run again, which resumes at that step; its state history never shows Failed or Crashed, the
unit task it stopped ends Preempted (not Crashed, as Prefect shows an exception that is not an Exception), and
the final weights are torch.equal to an uninterrupted deployment run's. A SIGKILL (a machine gone) is restarted by
the automation exactly once, however many Crashed reports the worker sends, and never shows Failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prefect.client.schemas.objects import StateType

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from tests.integration.stack_client import (
    ROOT,
    SYNTHETIC,
    flow_run_process,
    logs_containing,
    start_run,
    state_names,
    task_run_states,
    wait_for,
    wait_for_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PACED = "tests.recipes_for_tests:PacedRecipe"
STEPS = 16


def paced(folder: Path, run_name: str, record: Path) -> dict:
    args = {"num_samples": 256, "hidden": 256, "record_dir": str(record), "step_seconds": 0.15}
    return {**SYNTHETIC, "run_name": run_name, "save_folder": str(folder), "recipe": PACED, "recipe_args": args,
            "max_duration": f"{STEPS}ba", "save_interval": "4ba"}  # fmt: skip


def model_of(folder: Path, run_name: str) -> dict[str, torch.Tensor]:
    store = CheckpointStore(str(folder), run_name)
    info = store.latest(deep=True)
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


def test_sigterm_reschedules_the_run_itself_and_it_completes_bit_identically_never_failed(prefect_stack, tmp_path):
    folder = tmp_path / "runs"
    reference = start_run(prefect_stack, "train/default", {"config": paced(folder, "ref", tmp_path / "ref-ids")})
    wait_for_state(prefect_stack, reference, StateType.COMPLETED)
    record = tmp_path / "ids"
    run_id = start_run(prefect_stack, "train/default", {"config": paced(folder, "p", record)})
    # In the first or second of a unit's 4 steps (batches started: 4k+1 or 4k+2): the stop lands inside the unit.
    wait_for(lambda: (folder / "p" / "latest").exists() and in_a_step(record) and batches(record) % 4 in (1, 2), 240,
             "the first steps of a unit after the first")  # fmt: skip
    victim = flow_run_process(prefect_stack.worker.pid, run_id)
    unit = (batches(record) - 1) // 4

    os.kill(victim, signal.SIGTERM)

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
    got, want = model_of(folder, "p"), model_of(folder, "ref")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sigkill_restarts_the_run_exactly_once_and_its_history_never_shows_failed(prefect_stack, tmp_path):
    folder, record = tmp_path / "runs", tmp_path / "ids"
    run_id = start_run(prefect_stack, "train/default", {"config": paced(folder, "k", record)})
    wait_for(lambda: (folder / "k" / "latest").exists() and in_a_step(record), 240, "a step of unit 1")
    victim = flow_run_process(prefect_stack.worker.pid, run_id)

    os.kill(victim, signal.SIGKILL)

    # How a user of `prefect deployment run` waits for the real outcome: Crashed on the way is not it.
    waited = subprocess.run([sys.executable, "-m", "deployments.outcome", str(run_id), "--timeout", "400"],
                            cwd=ROOT, env=prefect_stack.env(), capture_output=True, text=True, timeout=460)  # fmt: skip
    assert waited.returncode == 0 and waited.stdout.startswith(f"flow run {run_id}: Completed"), waited
    names = state_names(prefect_stack, run_id)
    assert "Crashed" in names  # the death was seen, and the waiter did not stop there
    assert "Failed" not in names, names
    assert names.count("AwaitingRestart") == 1, names  # one restart, even if the death was reported twice
    store = CheckpointStore(str(folder), "k")
    assert store.fence.newest() == 2  # exactly one new attempt claimed the run and trained
    assert {i.manifest.writer.pid for i in store.list()} - {victim} != set()
