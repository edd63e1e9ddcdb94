"""Two real processes advancing one run: the newer writer wins, the older stops without writing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def command(folder: Path) -> list[str]:
    # The first process to take 20 steps waits there while the gate file exists (see GatedRecipe).
    args = {"num_samples": 1024, "gate_file": str(folder.parent / "gate"), "gate_at_step": 20}
    return [
        sys.executable,
        "-m",
        "flows.train",
        "--run_name",
        "f",
        "--save_folder",
        str(folder),
        "--recipe",
        "tests.recipes_for_tests:GatedRecipe",
        "--recipe_args",
        json.dumps(args),
        "--max_duration",
        "2ep",
        "--save_interval",
        "8ba",
        "--global_batch_size",
        "32",
        "--unit_retries",
        "0",
    ]


def start(folder: Path, env: dict, name: str) -> subprocess.Popen:
    out = open(folder.parent / f"{name}.log", "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(command(folder), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(predicate, proc: subprocess.Popen, folder: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline and proc.poll() is None, log(folder, "first")[-2000:]
        time.sleep(0.02)


def log(folder: Path, name: str) -> str:
    return (folder.parent / f"{name}.log").read_text()


def test_a_second_process_on_the_same_run_fences_the_first_and_finishes_it_exactly(tmp_path, prefect_env):
    folder, ref_folder = tmp_path / "runs", tmp_path / "ref" / "runs"
    ref_folder.parent.mkdir()
    reference = start(ref_folder, prefect_env, "reference")  # no gate file there: never waits
    gate = tmp_path / "gate"
    gate.touch()
    first = start(folder, prefect_env, "first")  # commits 2 units (16 steps), then waits at step 20
    wait_for(lambda: len(list((folder / "f" / "checkpoints").glob("*/manifest.json"))) == 2, first, folder)
    second = start(folder, prefect_env, "second")
    wait_for(lambda: (folder / "f" / "claims" / f"{2:012d}").exists(), second, folder)
    gate.unlink()  # the first writer goes on, and must be refused at its next commit

    assert second.wait(timeout=300) == 0, log(folder, "second")[-3000:]
    assert first.wait(timeout=300) == 1, "the first writer was not fenced: " + log(folder, "first")[-2000:]
    assert reference.wait(timeout=300) == 0
    assert "is stale and stops without writing" in log(folder, "first")

    store = CheckpointStore(str(folder), "f")
    pointer, newest_claim = store.read_pointer(), max(int(p.name) for p in (folder / "f" / "claims").iterdir())
    assert pointer["generation"] == newest_claim == 2
    latest = store.latest()
    assert latest.manifest.writer.generation == 2 and latest.progress["epoch"] == 2
    # Resumed from the first writer's checkpoint, the second ends exactly where one writer alone would.
    ours = store.load(latest, ["state.pt"]).objects["state.pt"]["state"]["model"]
    ref_store = CheckpointStore(str(ref_folder), "f")
    theirs = ref_store.load(ref_store.latest(), ["state.pt"]).objects["state.pt"]["state"]["model"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
