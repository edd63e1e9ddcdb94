"""A loop of the user's own on 2 processes: Ray Train's checkpointing example (recipes/ray_port.py) under real
torchrun, one of its ranks SIGKILLed, resuming exactly from its last report.

One rank killed: the gang ends cleanly (no hang), Prefect's retry starts a fresh gang, and ``get_checkpoint()`` on
every rank returns the last report; the run ends torch.equal to an uninterrupted 2-process run. The SIGKILL of the
whole flow-run process (its ranks die with it, the same command again resumes from the last report) is
tests/integration/test_own_loop_ranks.py::test_each_rank_resumes_its_own_rng_and_rank_state_after_a_sigkill_of_the_
launcher, on a loop of the same kind whose ranks also draw their own randomness (merged there, issue 47).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from tests.conftest import ROOT
from tests.procs import ranks_of, wait_until

pytestmark = pytest.mark.slow
RAY = "tests.own_loop_recipes:SlowRayPortRecipe"
EPOCHS = 24


def command(folder: Path, run_name: str, retries: int = 0) -> list[str]:
    return [sys.executable, "-m", "flows.train", "--run_name", run_name, "--save_folder", str(folder),
            "--recipe", RAY, "--recipe_args", json.dumps({"epoch_seconds": 0.15}), "--max_duration", f"{EPOCHS}ep",
            "--nproc_per_node", "2", "--seed", "3", "--unit_retries", str(retries), "--retry_delay_seconds", "0"]  # fmt: skip


def run(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def reports(folder: Path, run_name: str) -> int:
    latest = CheckpointStore(str(folder), run_name).read_pointer()
    return int(re.match(r"ep(\d+)-", latest["name"]).group(1)) if latest else 0


def final_weights(folder: Path, run_name: str) -> dict[str, torch.Tensor]:
    store = CheckpointStore(str(folder), run_name)
    info = store.latest(deep=True)
    assert info.progress["epoch"] == EPOCHS
    return store.load(info, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model_weights"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_env) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("ray-ref")
    proc = run(command(folder, "ref"), prefect_env, folder / "log")
    assert proc.wait(timeout=300) == 0, (folder / "log").read_text()[-3000:]
    return final_weights(folder, "ref")


def test_a_killed_rank_ends_the_attempt_cleanly_and_the_retry_resumes_from_the_last_report(
    tmp_path, prefect_env, reference
):
    proc = run(command(tmp_path, "r", retries=1), prefect_env, tmp_path / "run.log")
    wait_until(lambda: reports(tmp_path, "r") >= 5, proc, "5 reports", poll=0.02)
    victim = next(p for p in ranks_of(proc.pid) if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes())
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]

    log = (tmp_path / "run.log").read_text()
    assert "train_loop (attempt 2) on 2 process(es): the run's newest report is ep" in log
    assert ranks_of(proc.pid) == []
    got = final_weights(tmp_path, "r")
    assert all(torch.equal(got[k], reference[k]) for k in reference)
