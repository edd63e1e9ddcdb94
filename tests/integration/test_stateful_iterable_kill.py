"""A run fed by a stateful IterableDataset (training/position/iterable.py), really SIGKILLed mid-unit while it snapshots
every step, relaunched with the same command: the relaunch loads the stream's state saved beside its RNG state in the
newest snapshot and ends with the weights of a run that was never killed. Read in the training process, a Hugging Face
streaming dataset (``load_dataset("json", streaming=True)``, Hugging Face's own state). With ``num_workers=2``, a
torchdata-style stream of the recipe's own, read by two loader worker processes (killed with it: they are in its
process group): the state saved is torchdata's StatefulDataLoader's, every worker's stream state and sample count in
it (training/position/stream_workers.py); its samples are augmented with noise from the workers' own generators
(torch, random, numpy), which the relaunch's new workers draw as the uninterrupted run's did
(training/position/worker_seeds.py). A Hugging Face streaming dataset read by two workers is resumed from the store
in tests/unit/test_stream_workers.py (under a SIGKILL it takes this test's path, and would cost ~20-30 s more:
``datasets`` imported in every worker)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointing.export import model_weights
from tests.conftest import HOST_TIER_DIR, ROOT, wait_until
from tests.procs import group_gone
from tests.stateful_iterable_recipes import write_json_rows
from training.lifetimes import remove_orphaned_semaphores

pytestmark = pytest.mark.slow
HF_RECIPE = "tests.stateful_iterable_recipes:JsonStreamRecipe"  # datasets.load_dataset(..., streaming=True)
WORKERS_RECIPE = "tests.stream_worker_recipes:WorkerCountingStreamRecipe"  # each worker its share, augmented
STEP = re.compile(r"unit \d+: step (\d+),")
STARTED = re.compile(r"unit \d+ \(attempt \d+\): starting from (.+) at epoch \d+, step (\d+),")


def command(folder: str, recipe: str, num_workers: int = 0, steps: int = 40, **args: Any) -> list[str]:
    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "k", "--save_folder", folder,
        "--recipe", recipe, "--recipe_args", json.dumps({"hidden": 1024, "num_layers": 3, **args}),
        "--max_duration", f"{steps}ba", "--save_interval", "10ba", "--snapshot_interval", "1ba",
        "--global_batch_size", "32", "--seed", "7", "--log_every_n_steps", "1", "--num_workers", str(num_workers),
    ]  # fmt: skip


ENV = {
    "PYTHONPATH": str(ROOT),
    "TRAIN_HOST_TIER_DIR": HOST_TIER_DIR,
    "TRAIN_ALLOWED_RECIPES": f"{HF_RECIPE},{WORKERS_RECIPE}",
}


def run(cmd: list[str], log: Path) -> str:
    env = {**os.environ, **ENV}
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    assert done.returncode == 0, log.read_text()[-4000:]
    return log.read_text()


def kill_mid_unit(cmd: list[str], log: Path) -> int:
    """Starts ``cmd`` and SIGKILLs its process group once step 13 (inside the second unit) is done. Its loader workers'
    queues leave named semaphores in /dev/shm (14 a run: their unlinker, the group's resource tracker, died too): once
    the group is gone, they are removed at once (the product's own sweep removes them once they are old,
    training/lifetimes.py)."""
    env = {**os.environ, **ENV}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: any(int(s) >= 13 for s in STEP.findall(log.read_text())), 300, "step 13", proc, every=0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_until(lambda: group_gone(proc.pid), 60, "the killed process group to end", every=0.05)
        remove_orphaned_semaphores(older_than=0)
    return max(int(s) for s in STEP.findall(log.read_text()))


def test_a_hugging_face_streaming_dataset_killed_mid_unit_resumes_from_its_snapshot_bit_identical(tmp_path):
    """``load_dataset("json", streaming=True)`` over 4 files (a run of 40 steps of 32 crosses 3 file ends), each sample
    augmented with noise from the process's three generators: the relaunch restores Hugging Face's own state and the
    RNG states of the newest snapshot."""
    pytest.importorskip("datasets")
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    args = {"data_files": write_json_rows(tmp_path, files=4, rows=400), "augment": True}
    run(command(reference, HF_RECIPE, **args), tmp_path / "reference.log")
    finished = kill_mid_unit(command(killed, HF_RECIPE, **args), tmp_path / "killed.log")
    text = run(command(killed, HF_RECIPE, **args), tmp_path / "relaunched.log")
    started = STARTED.search(text)
    assert started and 10 < int(started.group(2)) < 40 and finished < 40, (finished, text[-4000:])  # mid-unit
    a, b = model_weights(f"{reference}/k", None)[0], model_weights(f"{killed}/k", None)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_augmented_stream_read_by_two_workers_killed_mid_unit_resumes_bit_identical(tmp_path):
    pytest.importorskip("torchdata")
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    workers = {"recipe": WORKERS_RECIPE, "num_workers": 2, "steps": 20}
    run(command(reference, **workers), tmp_path / "reference.log")
    finished = kill_mid_unit(command(killed, **workers), tmp_path / "killed.log")
    text = run(command(killed, **workers), tmp_path / "relaunched.log")
    started = STARTED.search(text)
    assert started and 10 < int(started.group(2)) < 20 and finished < 20, (finished, text[-4000:])  # mid-unit
    assert "stream workers started (num_workers=2)" in text  # the relaunch's own workers, from the saved state
    a, b = model_weights(f"{reference}/k", None)[0], model_weights(f"{killed}/k", None)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
