"""Warm trial runners (tasks/trial_runner.py, issue 46), in real processes, really killed: a sweep whose segments run
in K long-lived trial processes decides exactly what the same sweep with a fresh process per segment decides, with
bit-identical best weights; a runner SIGKILLed mid-segment is replaced and the segment resumes from its checkpoint;
a SIGKILLed sweep leaves no runner behind, idle or training, and its relaunch removes the trial folder it left.

The sweep of tests/integration/test_sweeps.py (4 trials, ASHA, 7 segments, 2 at a time), its helpers reused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from checkpointing.errors import LedgerError
from tasks.trial_runner import FOLDER_PREFIX, PROCESS_PER_SEGMENT_ENV
from tests.integration.test_sweeps import ARGS, NAME, Launch, best_weights, committed, events, starts, summary
from tests.procs import alive
from training.preemption import EXIT_CODE

pytestmark = pytest.mark.slow
WARM = re.compile(r"sweep: (\d+) trial segment\(s\) ran in (\d+) warm trial process\(es\)")


def sweep(base: Path, env: dict[str, str], **options: object) -> dict:
    launch = Launch(base / "runs", env, base / "sweep.log", **options)
    text = launch.finish()
    return {"summary": summary(base / "runs"), "best": best_weights(base / "runs"), "text": text}


@pytest.fixture(scope="module")
def both(tmp_path_factory, prefect_env) -> dict[str, dict]:
    """The same sweep twice: with a fresh process per segment (the internal switch), and with warm runners."""
    fresh_env = {**prefect_env, PROCESS_PER_SEGMENT_ENV: "1"}
    return {
        "fresh": sweep(tmp_path_factory.mktemp("fresh"), fresh_env),
        "warm": sweep(tmp_path_factory.mktemp("warm"), prefect_env),
    }


def test_warm_runners_decide_and_train_exactly_as_a_process_per_segment(both):
    fresh, warm = both["fresh"], both["warm"]
    assert not WARM.search(fresh["text"])
    used = WARM.search(warm["text"])
    assert used and int(used.group(1)) == 7 and int(used.group(2)) <= 2, warm["text"][-3000:]  # 7 segments, 2 runners
    assert warm["summary"] == fresh["summary"]  # every decision and unit metric (train_loss, eval) bit-identical
    assert warm["best"].keys() == fresh["best"].keys()
    assert all(torch.equal(warm["best"][k], fresh["best"][k]) for k in warm["best"])
    for trial in warm["summary"]["trials"]:  # each run started from nothing once, then always from its checkpoint
        assert starts(warm["text"], trial["run_name"]).count("no checkpoint") == 1


def test_a_runner_killed_mid_segment_is_replaced_and_the_segment_resumes(tmp_path, prefect_env, both):
    folder = tmp_path / "runs"
    launch = Launch(folder, prefect_env, tmp_path / "sweep.log")
    try:
        last: list[str | None] = [None]

        def last_segment_started() -> bool:  # the trial ASHA takes to 4 units, from its unit-2 checkpoint
            try:
                ledger = events(folder)
            except LedgerError:  # a folder read while the sweep renames an event into place may show a later event
                return False  # and not that one (a directory read is not a snapshot): this reader reads again
            found = [e for e in ledger if e.kind == "segment_started" and e.body["target_units"] == 4]
            last[0] = found[0].body["run_name"] if found else None
            return last[0] is not None

        launch.wait_until(lambda: (folder / NAME).exists() and last_segment_started(), "the segment to 4 units")
        run = str(last[0])
        launch.wait_until(lambda: (committed(folder, run) or {}).get("step", 0) >= 24, f"{run}'s unit 3 committed")
        pids = [pid for pid, name in launch.trial_processes().items() if name == run]
        assert len(pids) == 1, launch.trial_processes()
        os.kill(pids[0], signal.SIGKILL)
        text = launch.finish()
    finally:
        launch.close()
    assert not alive(pids[0])
    assert starts(text, run) == ["no checkpoint", "checkpoint ep1-ba8-sa256", "checkpoint ep2-ba16-sa512",
                                 "checkpoint ep3-ba24-sa768"], text[-4000:]  # fmt: skip
    last_segment = [e.body for e in events(folder) if e.kind == "segment_finished" and e.body["run_name"] == run][-1]
    assert last_segment["units_trained"] == 1 and last_segment["started_from"] == "checkpoint ep3-ba24-sa768"
    used = WARM.search(text)
    assert used and int(used.group(1)) == 8 and int(used.group(2)) <= 3, text[-3000:]  # 7 segments and the retry
    assert summary(folder) == both["warm"]["summary"]


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
