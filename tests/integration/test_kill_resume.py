"""The one flow-level kill test: ``python -m flows.train`` (on the session's Prefect test server), really SIGKILLed in
the middle of a checkpoint write and relaunched with the same command, resumes from the previous checkpoint and ends
bit-identical (weights, optimizer, scheduler) to a run that was never killed. Its reference runs through the
Prefect-free lifecycle (``tests.run_lifecycle``): the flow must end where the lifecycle does.

A kill at a random moment (the seeded scenario) is tested without Prefect in test_host_memory_kill.py, with these
same full-state assertions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from tests.conftest import ROOT, wait_until

pytestmark = pytest.mark.slow
# ~19 MB of state per checkpoint, so that writing one takes long enough to be killed in the middle.
RECIPE_ARGS = {"num_samples": 256, "hidden": 1536, "num_layers": 3}


def command(folder: Path, module: str = "flows.train") -> list[str]:
    return [
        sys.executable,
        "-m",
        module,
        "--run_name",
        "k",
        "--save_folder",
        str(folder),
        "--recipe",
        "recipes.synthetic:SyntheticRecipe",
        "--recipe_args",
        json.dumps(RECIPE_ARGS),
        "--max_duration",
        "16ba",
        "--save_interval",
        "2ba",
        "--global_batch_size",
        "32",
        "--seed",
        "7",
        "--unit_retries",
        "0",
    ]


def launch(folder: Path, env: dict, log_name: str, module: str = "flows.train") -> subprocess.Popen:
    log = open(folder.parent / f"{log_name}.log", "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(command(folder, module), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_to_completion(folder: Path, env: dict, log_name: str, module: str = "flows.train") -> None:
    proc = launch(folder, env, log_name, module)
    assert proc.wait(timeout=300) == 0, (folder.parent / f"{log_name}.log").read_text()[-3000:]


def final_state(folder: Path) -> dict:
    store = CheckpointStore(str(folder), "k")
    return store.load(store.latest(), files=["state.pt"]).objects["state.pt"]["state"]


def pointer_step(folder: Path) -> int:
    try:
        name = json.loads((folder / "k" / "latest").read_text())["name"]
    except (FileNotFoundError, ValueError):
        return -1
    return int(name.split("-ba")[1].split("-")[0])


def wait_for(predicate, proc: subprocess.Popen, seconds: float = 120):
    """The kill point: waits (scaled by the machine's load) until ``predicate`` finds it while ``proc`` runs."""
    return wait_until(predicate, seconds, "the kill point", proc)


def torn_checkpoint(folder: Path):
    """A checkpoint folder whose state file exists but whose manifest does not yet: a write in progress."""
    root = folder / "k" / "checkpoints"
    if not root.exists():
        return None
    for d in root.iterdir():
        if d.name.endswith("ba6-sa192") and (d / "state.pt").exists() and not (d / "manifest.json").exists():
            return d
    return None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, without Prefect (53 s where the flow with its server took 128 s: issue 47)."""
    folder = tmp_path_factory.mktemp("reference") / "runs"
    run_to_completion(folder, {**os.environ, "PYTHONPATH": str(ROOT)}, "reference", "tests.run_lifecycle")
    return final_state(folder)


def assert_equal_state(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, s in a["optimizer"]["state"].items():
        assert torch.equal(s["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"]), i
    assert a["scheduler"] == b["scheduler"]


def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one_bit_identically(tmp_path, prefect_env, reference):
    folder = tmp_path / "runs"
    proc = launch(folder, prefect_env, "killed")
    torn = wait_for(lambda: torn_checkpoint(folder), proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    assert not (torn / "manifest.json").exists()  # the kill landed between the files and the manifest
    assert CheckpointStore(str(folder), "k").latest().name == "ep0-ba4-sa128"
    run_to_completion(folder, prefect_env, "relaunched")
    assert_equal_state(final_state(folder), reference)
