"""A rank that dies is a crash of that rank, whatever the survivors saw: real torchrun, 2 gloo processes, a real
SIGKILL of one rank (issue 44, item 1).

torchrun stops the other ranks of a dead one with a SIGTERM; a survivor waiting for it at a meeting point read that
as a preemption (task and flow run Preempted, exit 143, no retry). The launcher now decides from evidence
(training/distributed/deaths.py): the attempt is a crash of the dead rank, named in one line, retried, and the run
ends bit-identical to an uninterrupted one; a rank that dies at the same step in every attempt ends the run Failed
once its retries are spent; a SIGTERM to the launcher itself is still a preemption.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests import deadlines
from tests.conftest import ROOT
from tests.integration.test_own_loop_ranks import EPOCHS, final_state
from tests.procs import environ, ranks_of, wait_until
from training.exceptions import RankDied
from training.preemption import EXIT_CODE, Preempted

pytestmark = pytest.mark.slow
NOISE = "tests.own_loop_recipes:RankNoiseRecipe"
DYING = "tests.rank_death_recipes:DyingRankRecipe"
DIES = re.compile(r"ERROR .* rank 1 died \(SIGKILL, exit -9\) after step (\d+); torchrun stopped the other ranks")


@pytest.fixture(scope="module")
def env(prefect_env) -> dict[str, str]:
    return {**prefect_env, "TRAIN_ALLOWED_RECIPES": f"{prefect_env['TRAIN_ALLOWED_RECIPES']},{NOISE},{DYING}"}


def start(folder: Path, name: str, recipe: str, args: dict, env: dict, retries: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.train", "--run_name", name, "--save_folder", str(folder), "--recipe", recipe,
           "--recipe_args", json.dumps(args), "--max_duration", f"{EPOCHS}ep", "--nproc_per_node", "2",
           "--seed", "5", "--unit_retries", str(retries), "--retry_delay_seconds", "0"]  # fmt: skip
    out = open(folder / f"{name}.log", "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
    return code, log.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("death-ref")
    code, log = finish(start(folder, "ref", NOISE, {"epoch_seconds": 0.0}, env, 0), folder / "ref.log")
    assert code == 0, log[-3000:]
    return final_state(folder, "ref")[0]


def test_a_rank_killed_while_the_other_waits_is_a_crash_retried_to_a_bit_identical_end(tmp_path, env, reference):
    code, log = finish(start(tmp_path, "once", DYING, {"die_at": 7}, env, 1), tmp_path / "once.log")
    assert code == 0, log[-4000:]
    assert DIES.findall(log) == ["6"], log[-4000:]  # one line naming the rank, its exit and its last reported step
    assert "Retry 1/1 will start" in log and "state Preempted" not in log, log[-4000:]
    model = final_state(tmp_path, "once")[0]
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model)


def test_a_rank_that_dies_at_the_same_step_every_time_ends_failed_with_one_line(tmp_path, env):
    t0 = time.monotonic()
    code, log = finish(start(tmp_path, "always", DYING, {"die_at": 3, "always": True}, env, 1), tmp_path / "always.log")
    assert code not in (0, EXIT_CODE), log[-4000:]
    assert time.monotonic() - t0 < 180
    steps = DIES.findall(log)
    assert len(set(steps)) == 1 and len(steps) >= 2, log[-4000:]  # both attempts: the same rank, exit and step
    assert "Finished in state Failed" in log and "state Preempted" not in log, log[-4000:]
    repeated = "the same crash again in attempt 2: rank 1 died (exit -9) after step 2, as in the attempt before"
    assert log.count(repeated) == 1, log[-4000:]


def test_a_sigterm_to_the_launcher_is_still_a_preemption(tmp_path, env):
    proc = start(tmp_path, "term", NOISE, {"epoch_seconds": 0.3}, env, 1)
    wait_until(lambda: "ep3-" in (tmp_path / "term.log").read_text(), proc, "a third report")
    proc.send_signal(signal.SIGTERM)
    code, log = finish(proc, tmp_path / "term.log", timeout=90)
    assert code == EXIT_CODE, log[-4000:]
    assert "Flow run 'term' - Finished in state Preempted" in log, log[-4000:]
    assert not DIES.search(log) and "RankDied" not in log, log[-4000:]


def ddp_config(folder: Path):
    from training.config import TrainConfig

    return TrainConfig(
        run_name="d", save_folder=str(folder), recipe="recipes.synthetic:SyntheticRecipe", nproc_per_node=2,
        recipe_args={"num_samples": 4000, "hidden": 256}, max_duration="2ep", save_interval="1ep",
        global_batch_size=16, seed=7, unit_retries=0,
    )  # fmt: skip


def rank_pid(rank: int) -> int | None:
    for pid in ranks_of(os.getpid()):
        if f"RANK={rank}".encode() in environ(pid).split(b"\0"):
            return pid
    return None


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    from tests.lifecycle import train_to_end

    config = ddp_config(tmp_path_factory.mktemp("ddp-ref"))
    train_to_end(config)
    return ddp_state(config)


def ddp_state(config) -> dict[str, torch.Tensor]:
    from checkpointing import CheckpointStore

    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest(), files=["state.pt"]).objects["state.pt"]["state"]["model"]


# Rank 1 killed mid-unit: tests/integration/test_distributed.py::test_killing_one_rank_fails_the_unit_cleanly_and_the_
# retry_resumes (DDP and FSDP: the retry's recorded failure is RankDied naming rank 1 and SIGKILL, the retry resumes
# from the checkpoint, no rank is left) and test_a_rank_killed_while_the_other_waits_... above (bit-identical end).
def test_a_ddp_rank_killed_mid_unit_is_a_crash_of_that_rank(tmp_path, train_run, ddp_reference):
    victim = 0  # the rank that commits: its death is a crash too, named, and the retry ends bit-identical
    config = ddp_config(tmp_path)
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(error=_raised(train_run, config)))
    runner.start()
    pointer = tmp_path / "d" / "latest"
    deadline = deadlines.deadline(120)
    while not pointer.exists() or rank_pid(victim) is None:  # unit 0 committed; unit 1 trains
        assert time.monotonic() < deadline and runner.is_alive(), "unit 0 never committed"
        time.sleep(0.02)
    time.sleep(0.3)
    os.kill(rank_pid(victim), signal.SIGKILL)
    runner.join(timeout=120)
    error = outcome["error"]
    assert isinstance(error, RankDied) and not isinstance(error, Preempted), repr(error)
    assert str(error).startswith(f"rank {victim} died (SIGKILL, exit -9)"), str(error)
    assert ranks_of(os.getpid()) == []

    train_run(config)  # the retry: resumes from unit 0's checkpoint
    model = ddp_state(config)
    assert all(torch.equal(model[k], ddp_reference[k]) for k in ddp_reference)


def _raised(train_run, config) -> BaseException | None:
    try:
        train_run(config)
    except BaseException as exc:
        return exc
    return None
