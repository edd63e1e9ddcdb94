"""A loop of the user's own on 2 processes under real torchrun: every rank's own state, and ranks that do not meet.

Each rank draws its own randomness (the global RNG seeded by rank, and a generator kept in ``rank_state``); after a
SIGKILL of the launcher its ranks die with it (nothing outlives the unit) and the relaunch resumes from the last
report and ends torch.equal to an uninterrupted run, with no gather written by the user. (That kill is the one of
test_custom_loop_distributed.py too, whose own test of it was merged here: issue 47.)
Ray's habit of reporting from rank 0 only (rank 1 goes on to its next DDP step) ends the run with an error that says
what to do within seconds, and a SIGTERM ends a rank's wait at a report long before that timeout.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from tests.conftest import ROOT
from tests.procs import alive, ranks_of, wait_until
from training.preemption import EXIT_CODE

pytestmark = pytest.mark.slow
NOISE = "tests.own_loop_recipes:RankNoiseRecipe"
RANK_ZERO = "tests.own_loop_recipes:RankZeroReportRecipe"
EPOCHS = 20


@pytest.fixture(scope="module")
def env(prefect_env) -> dict[str, str]:
    return {**prefect_env, "TRAIN_ALLOWED_RECIPES": f"{prefect_env['TRAIN_ALLOWED_RECIPES']},{NOISE},{RANK_ZERO}"}


def command(folder: Path, run_name: str, recipe: str, args: dict, duration: str = f"{EPOCHS}ep") -> list[str]:
    return [sys.executable, "-m", "flows.train", "--run_name", run_name, "--save_folder", str(folder),
            "--recipe", recipe, "--recipe_args", json.dumps(args), "--max_duration", duration,
            "--nproc_per_node", "2", "--seed", "5", "--unit_retries", "0", "--retry_delay_seconds", "0"]  # fmt: skip


def run(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def reports(folder: Path, run_name: str) -> int:
    latest = CheckpointStore(str(folder), run_name).read_pointer()
    return int(re.match(r"ep(\d+)-", latest["name"]).group(1)) if latest else 0


def final_state(folder: Path, run_name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    store = CheckpointStore(str(folder), run_name)
    info = store.latest(deep=True)
    assert info.progress["epoch"] == EPOCHS
    return store.load(info, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"], sorted(info.manifest.files)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("noise-ref")
    proc = run(command(folder, "ref", NOISE, {"epoch_seconds": 0.0}), env, folder / "log")
    assert proc.wait(timeout=300) == 0, (folder / "log").read_text()[-3000:]
    return final_state(folder, "ref")[0]


def test_each_rank_resumes_its_own_rng_and_rank_state_after_a_sigkill_of_the_launcher(tmp_path, env, reference):
    proc = run(command(tmp_path, "k", NOISE, {"epoch_seconds": 0.2}), env, tmp_path / "killed.log")
    wait_until(lambda: reports(tmp_path, "k") >= 5, proc, "5 reports")
    ranks = ranks_of(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(map(alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(ranks) == 2 and not any(map(alive, ranks)), "rank processes outlived the killed run"
    killed_at = reports(tmp_path, "k")
    assert 5 <= killed_at < EPOCHS

    again = run(command(tmp_path, "k", NOISE, {"epoch_seconds": 0.2}), env, tmp_path / "relaunched.log")
    assert again.wait(timeout=300) == 0, (tmp_path / "relaunched.log").read_text()[-3000:]

    assert f"the run's newest report is ep{killed_at}-" in (tmp_path / "relaunched.log").read_text()
    got, files = final_state(tmp_path, "k")
    assert {"rng-rank0.pt", "rng-rank1.pt", "rank-state-rank0.pt", "rank-state-rank1.pt"} <= set(files)
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_a_world_size_change_between_launches_is_one_line(tmp_path, env):
    first = run(command(tmp_path, "w", NOISE, {"epoch_seconds": 0.0}, "3ep"), env, tmp_path / "two.log")
    assert first.wait(timeout=300) == 0, (tmp_path / "two.log").read_text()[-3000:]
    one = command(tmp_path, "w", NOISE, {"epoch_seconds": 0.0}, "5ep")
    one[one.index("--nproc_per_node") + 1] = "1"
    second = run(one, env, tmp_path / "one.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "one.log").read_text()[-3000:]
    lines = [x for x in (tmp_path / "one.log").read_text().splitlines() if "world size changed 2 -> 1" in x]
    assert len(lines) == 1, lines
    assert "ep3-ba3-sa0 resumes on every rank; the rank_state and RNG state of rank 1 are not resumed" in lines[0]


def test_a_report_on_rank_0_only_is_a_clear_error_within_seconds_not_a_hang(tmp_path, env):
    t0 = time.monotonic()
    proc = run(command(tmp_path, "z", RANK_ZERO, {"timeout": 3.0}), env, tmp_path / "log")
    try:
        code = proc.wait(timeout=150)
    finally:
        proc.kill()
    log = (tmp_path / "log").read_text()
    assert code not in (0, None), log[-3000:]
    assert "rank 0: ctx.report(); rank 1: not there within 3 s" in log, log[-3000:]
    assert "call ctx.report(...)" in log and "on every rank at the same point" in log
    assert time.monotonic() - t0 < 150
    assert ranks_of(proc.pid) == []


def test_a_sigterm_ends_a_rank_s_wait_at_a_report(tmp_path, env):
    proc = run(command(tmp_path, "t", RANK_ZERO, {"timeout": 600.0}), env, tmp_path / "log")
    wait_until(lambda: "rank 0 waits at ctx.report() for rank 1" in (tmp_path / "log").read_text(), proc, "a wait")
    ranks = ranks_of(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=90)
    finally:
        proc.kill()
    log = (tmp_path / "log").read_text()
    assert code == EXIT_CODE, log[-3000:]
    assert time.monotonic() - t0 < 60, "the SIGTERM was not honoured while rank 0 waited"
    assert "rank 1 never reached ctx.report(); nothing new was committed" in log, log[-3000:]
    deadline = time.monotonic() + 30
    while any(map(alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, ranks)), "rank processes outlived the stopped run"
