"""Warm trial runners (tasks/trial_runner.py, issue 46), in real processes, really killed: a sweep whose segments run
in K long-lived trial processes decides exactly what the same sweep with a fresh process per segment decides, with
bit-identical best weights; a SIGKILLed sweep leaves no runner behind, idle or training, and its relaunch removes the
trial folder it left. A runner SIGKILLed mid-segment is replaced and the segment resumes from its checkpoint:
tests/integration/test_sweeps.py::test_a_killed_trial_process_is_retried_and_resumes (its trial process is a warm
runner; the test of that here was merged into it, issue 47).

The sweep of tests/integration/test_sweeps.py (ASHA, 2 at a time), its helpers reused; the comparison runs a smaller
one (SMALL: 2 trials to 1 unit, the better one to 2: 3 segments in at most 2 runners, so one runner trains a second
segment after another trial's, and the resumed segment runs in a runner that trained before).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from tasks.trial_runner import FOLDER_PREFIX, PROCESS_PER_SEGMENT_ENV
from tests.integration.test_sweeps import ARGS, WARM, Launch, best_weights, starts, summary
from tests.procs import alive
from training.preemption import EXIT_CODE

pytestmark = pytest.mark.slow
# 2 trials, 2 at a time, rungs at 1 and 2 units: t000 and t001 to 1 unit, the better one on to 2 (3 segments); no
# sleep per step (nothing is killed here), so the fixed costs the runners save are most of what the sweep takes
SMALL = {"num_samples": 2, "max_duration": "2ep", "recipe_args": json.dumps({**ARGS, "step_seconds": 0.0})}


def sweep(base: Path, env: dict[str, str], **options: object) -> dict:
    launch = Launch(base / "runs", env, base / "sweep.log", **options)
    text = launch.finish()
    return {"summary": summary(base / "runs"), "best": best_weights(base / "runs"), "text": text}


@pytest.fixture(scope="module")
def both(tmp_path_factory, prefect_env) -> dict[str, dict]:
    """The same sweep twice: with a fresh process per segment (the internal switch), and with warm runners."""
    fresh_env = {**prefect_env, PROCESS_PER_SEGMENT_ENV: "1"}
    return {
        "fresh": sweep(tmp_path_factory.mktemp("fresh"), fresh_env, **SMALL),
        "warm": sweep(tmp_path_factory.mktemp("warm"), prefect_env, **SMALL),
    }


def test_warm_runners_decide_and_train_exactly_as_a_process_per_segment(both):
    fresh, warm = both["fresh"], both["warm"]
    assert not WARM.search(fresh["text"])
    used = WARM.search(warm["text"])
    assert used and int(used.group(1)) == 3 and int(used.group(2)) <= 2, warm["text"][-3000:]  # 3 segments, 2 runners
    assert sorted(t["units"][-1]["unit"] for t in warm["summary"]["trials"]) == [1, 2], warm["summary"]
    assert warm["summary"] == fresh["summary"]  # every decision and unit metric (train_loss, eval) bit-identical
    assert warm["best"].keys() == fresh["best"].keys()
    assert all(torch.equal(warm["best"][k], fresh["best"][k]) for k in warm["best"])
    for trial in warm["summary"]["trials"]:  # each run started from nothing once, then always from its checkpoint
        assert starts(warm["text"], trial["run_name"]).count("no checkpoint") == 1


def test_a_killed_sweep_leaves_no_runner_behind_and_its_relaunch_no_folder(tmp_path, prefect_env):
    """SIGKILL to the sweep alone while its runners train (8 s units): the kernel ends them (PR_SET_PDEATHSIG); an
    idle runner would also end at its stdin's EOF, a training one only when its segment ended. Its trial folder
    (<tmp>/sweep-runners-<pid>-*) stays: nothing of it ran to remove it. The relaunch removes it, and its own at its
    end (stopped here by SIGTERM): nothing of either sweep is left in the temporary folder."""
    folder, tmp = tmp_path / "runs", tmp_path / "tmp"
    tmp.mkdir()
    env = {**prefect_env, "TMPDIR": str(tmp)}
    slow = {"recipe_args": json.dumps({**ARGS, "step_seconds": 1.0}), "max_concurrent_trials": 3}
    launch = Launch(folder, env, tmp_path / "sweep.log", **slow)
    try:
        launch.wait_until(lambda: len(launch.trial_processes()) >= 2, "two runners training")
        runners = set(launch.trials)
        launch.proc.send_signal(signal.SIGKILL)
        assert launch.proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 5  # PDEATHSIG is immediate; a runner left alone would train on for seconds
        while [p for p in runners if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in runners if alive(p)], "a warm runner outlived its killed sweep"
    finally:
        launch.close()
    left = list(tmp.glob(f"{FOLDER_PREFIX}{launch.proc.pid}-*"))
    assert len(left) == 1 and list(left[0].glob("runner-*.json")), sorted(tmp.iterdir())  # what the kill left
    again = Launch(folder, env, tmp_path / "again.log", **slow)
    try:
        again.wait_until(lambda: not left[0].exists() and again.trial_processes(), "the relaunch's runners")
        again.proc.send_signal(signal.SIGTERM)  # a stop request: the sweep ends as it would at its end
        assert again.proc.wait(timeout=120) == EXIT_CODE, again.text()[-3000:]
    finally:
        again.close()
    assert not [p for p in again.trials if alive(p)]
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith((FOLDER_PREFIX, "trial-"))) == []
