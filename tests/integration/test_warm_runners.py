"""Warm trial runners (tasks/trial_runner.py, issue 46), in real processes, really killed: a sweep whose segments run
in K long-lived trial processes decides exactly what the same sweep with a fresh process per segment decides, with
bit-identical best weights. The kills were merged into tests/integration/test_sweeps.py (issue 47): a runner
SIGKILLed mid-segment is replaced and the segment resumes from its checkpoint
(test_a_killed_trial_process_is_retried_and_resumes); a SIGKILLed sweep leaves no runner behind, idle or training,
and its relaunch removes the trial folder it left (test_sweep_killed_anywhere_continues_with_no_trial_starting_over,
four kills); a stopped sweep (SIGTERM) removes its own (test_a_preempted_sweep_commits_and_resumes).

The sweep of tests/integration/test_sweeps.py (ASHA, 2 at a time), its helpers reused; the comparison runs a smaller
one (SMALL: 2 trials to 1 unit, the better one to 2: 3 segments in at most 2 runners, so one runner trains a second
segment after another trial's, and the resumed segment runs in a runner that trained before).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.trial_runner import PROCESS_PER_SEGMENT_ENV
from tests.integration.test_sweeps import ARGS, WARM, Launch, best_weights, starts, summary

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
