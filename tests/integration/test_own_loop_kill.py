"""A loop of the user's own in a real process, really SIGKILLed mid-run and relaunched with the same command: it
resumes from the last report and ends with the weights of an uninterrupted run. Launched through the Prefect-free
lifecycle (``tests.run_lifecycle``): Prefect is not what is tested (test_own_loop_flow.py runs the loop in the flow)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, seeds
from tests.integration.test_kill_resume import assert_equal_state, final_state, pointer_step, wait_for

pytestmark = pytest.mark.slow
# ~19 MB of state per report (as in test_kill_resume), reported every 2 of the 16 steps.
RECIPE_ARGS = {"num_samples": 256, "hidden": 1536, "num_layers": 3, "report_every": 2}


def command(folder: Path) -> list[str]:
    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "k", "--save_folder", str(folder),
        "--recipe", "recipes.custom_loop:CustomLoopRecipe", "--recipe_args", json.dumps(RECIPE_ARGS),
        "--max_duration", "16ba", "--global_batch_size", "32", "--seed", "7", "--unit_retries", "0",
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def run(folder: Path, env: dict, log_name: str) -> subprocess.Popen:
    log = open(folder.parent / f"{log_name}.log", "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(command(folder), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_to_completion(folder: Path, env: dict, log_name: str) -> str:
    proc = run(folder, env, log_name)
    log = folder.parent / f"{log_name}.log"
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    return log.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference") / "runs"
    run_to_completion(folder, environment(), "reference")
    return final_state(folder)


@pytest.mark.parametrize("seed", seeds(1, 2))
def test_sigkill_mid_loop_then_relaunch_resumes_from_the_last_report_bit_identically(tmp_path, reference, seed):
    folder = tmp_path / "runs"
    proc = run(folder, environment(), "killed")
    wait_for(lambda: pointer_step(folder) >= 4, proc)
    time.sleep(random.Random(seed).uniform(0.0, 0.3))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = pointer_step(folder)
    assert 4 <= killed_at < 16, "killed too late to test anything"

    log = run_to_completion(folder, environment(), "relaunched")

    # The relaunch resumed from the last report (or from one committed after it, if the kill fell between a
    # manifest and the move of latest), not from the start.
    resumed = re.search(r"train_loop \(attempt 1\) on 1 process\(es\): the run's newest report is ep\d+-ba(\d+)-", log)
    assert resumed and killed_at <= int(resumed.group(1)) <= killed_at + 2, log[-3000:]
    assert_equal_state(final_state(folder), reference)
