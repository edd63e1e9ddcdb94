"""A sweep (python -m flows.sweep, ASHA) in real processes, really killed: SIGKILLed at random moments and launched
again with the same command, a trial's process SIGKILLed mid-unit, a SIGTERM to the sweep. Each time the sweep ends
deciding exactly what an uninterrupted sweep decided, with its best weights, and no trial run starts over: every
trial's run logs "no checkpoint" once, unless it was killed before it had committed anything.

4 trials, 2 at a time, rungs at 1, 2 and 4 units (grace_period 1, reduction_factor 2): 7 trial segments, run in at
most 2 warm trial processes (tasks/trial_runner.py, the default); a unit is an epoch of 8 steps of at least
STEP_SECONDS, so the trials are training when killed. The trial process SIGKILLed mid-unit is such a warm runner: its
test also checks that it was replaced (test_warm_runners.py's own kill test was merged into it, issue 47).
"""

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
import torch

from checkpointing import CheckpointStore, Ledger, open_checkpoint_uri
from checkpointing.errors import LedgerError
from checkpointing.io.storage import Storage
from checkpointing.store import STATE_FILE
from deployments.stack import descendants
from tasks.trial_runner import FOLDER_PREFIX
from tests.conftest import ROOT
from tests.procs import alive, cmdline
from training.preemption import EXIT_CODE
from training.sweep import Study

pytestmark = pytest.mark.slow
NAME = "sw"
STEP_SECONDS = 0.1
ARGS = {"num_samples": 256, "step_seconds": STEP_SECONDS}  # 8 steps of 32 samples a unit
TIMINGS = ("samples_per_second", "train_seconds")  # a unit's speed: differs between any two runs
TRIAL_ERROR = re.compile(r"error: run 't\d{3}'")  # a trial process's own line, passed through the sweep's output
GRACE = 25.0  # preemption_grace_seconds' default: the trials' grace
WARM = re.compile(r"sweep: (\d+) trial segment\(s\) ran in (\d+) warm trial process\(es\)")  # the pool's last line


def command(save_folder: Path | str, scheduler: str = "asha", **options: object) -> list[str]:
    flags = {
        "recipe": "tests.recipes_for_tests:SteadySyntheticRecipe",
        "recipe_args": json.dumps(ARGS),
        "max_duration": "4ep",
        "save_interval": "1ep",
        "global_batch_size": 32,
        "seed": 7,
        "save_folder": str(save_folder),
        "sweep_name": NAME,
        "space": json.dumps({"recipe_args.lr": {"loguniform": [0.001, 0.1]}}),
        "num_samples": 4,
        "max_concurrent_trials": 2,
        "eval_each_unit": "true",
        "metric": "eval_accuracy",
        "mode": "max",
        "scheduler": scheduler,
        "grace_period": 1,
        "reduction_factor": 2,
        **options,
    }
    return [sys.executable, "-m", "flows.sweep", *(a for k, v in flags.items() for a in (f"--{k}", str(v)))]


class Launch:
    """One `python -m flows.sweep` process (a session of its own: nothing of it outlives the test), its output,
    and every trial process seen below it."""

    def __init__(self, folder: Path, env: dict[str, str], log: Path, **options: object):
        self.folder, self.log = folder, log
        self._out = open(log, "w")  # noqa: SIM115 - the sweep and its trials write it until they exit
        cmd = command(folder, **options)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.trials: set[int] = set()

    def text(self) -> str:
        return self.log.read_text()

    def trial_processes(self) -> dict[int, str]:
        """The live trial processes below the sweep, by pid: the run each trains (from its spec file)."""
        found = {}
        for pid in descendants(self.proc.pid):
            argv = cmdline(pid).split(b"\0")
            if b"flows.sweep_trial" in argv:
                self.trials.add(pid)
                try:
                    found[pid] = json.loads(Path(argv[argv.index(b"flows.sweep_trial") + 1].decode()).read_text())
                except (OSError, ValueError, IndexError):
                    continue
        return {pid: spec["config"]["run_name"] for pid, spec in found.items()}

    def wait_until(self, predicate, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self.trial_processes()
            assert self.proc.poll() is None, f"the sweep ended before {what}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL to the sweep's process alone: its trials must die with it (PR_SET_PDEATHSIG)."""
        self.trial_processes()
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while [p for p in self.trials if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in self.trials if alive(p)], "a trial process outlived its killed sweep"

    def finish(self, timeout: float = 600) -> str:
        code = self.proc.wait(timeout=timeout)
        self.close()
        assert code == 0, self.text()[-4000:]
        return self.text()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._out.close()


def events(folder: Path) -> list:
    return Ledger(Storage(str(folder / NAME))).read()


def summary(folder: Path) -> dict:
    """The sweep's decisions, with its folder written as <sweep> and the units' wall-clock figures left out: two
    sweeps in two folders compare equal (every other metric, the eval ones included, must be bit-identical)."""
    text = json.dumps(Study.fold(events(folder)).summary(), sort_keys=True)
    decided = json.loads(text.replace(str(folder / NAME), "<sweep>"))
    for trial in decided["trials"]:
        for unit in trial["units"]:
            unit["metrics"] = {k: v for k, v in unit["metrics"].items() if k not in TIMINGS}
    return decided


def best_weights(folder: Path) -> dict[str, torch.Tensor]:
    best = Study.fold(events(folder)).finished
    assert best is not None and str(folder / NAME) in best["best_checkpoint"], best
    return open_checkpoint_uri(best["best_checkpoint"], files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]


def starts(text: str, run: str) -> list[str]:
    """What each start of ``run`` logged: "no checkpoint", or "checkpoint <name>"."""
    return re.findall(rf"run {re.escape(run)} in \S+: (no checkpoint|checkpoint \S+); training to", text)


def committed(folder: Path, run: str) -> dict | None:
    """The progress of the run's newest committed checkpoint (None: none yet)."""
    info = CheckpointStore(str(folder / NAME), run).latest()
    return dict(info.progress) if info is not None else None


def units_trained(folder: Path) -> int:
    return sum(e.body.get("units_trained", 0) for e in events(folder) if e.kind == "segment_finished")


def rung_budget(reference: dict) -> int:
    """The units ASHA must train: each trial up to the highest rung it reached, once."""
    return sum(t["units"][-1]["unit"] for t in reference["trials"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_env) -> dict:
    """An uninterrupted sweep: its decisions, best weights, output, units trained and wall time."""
    base = tmp_path_factory.mktemp("reference")
    t0 = time.monotonic()
    launch = Launch(base / "runs", prefect_env, base / "sweep.log")
    text = launch.finish()
    seconds = time.monotonic() - t0
    return {
        "summary": summary(base / "runs"),
        "best": best_weights(base / "runs"),
        "text": text,
        "units_trained": units_trained(base / "runs"),
        "seconds": seconds,
    }


def test_the_reference_sweep_runs_7_segments_and_trains_each_unit_once(reference):
    decided = reference["summary"]
    assert [t["trial"] for t in decided["trials"]] == ["t000", "t001", "t002", "t003"]
    reached = sorted(t["units"][-1]["unit"] for t in decided["trials"])
    assert reached == [1, 1, 2, 4], decided  # ASHA's rungs: 4 trials to 1 unit, 2 to 2, 1 to 4
    assert all(t["state"] in ("stopped", "completed") for t in decided["trials"])
    assert reference["units_trained"] <= 1.05 * rung_budget(decided)  # paused and resumed, never retrained
    for trial in decided["trials"]:
        assert starts(reference["text"], trial["run_name"]).count("no checkpoint") == 1


def recorded(folder: Path, kind: str | None = None) -> int:
    """How many events (of ``kind``) the sweep's ledger holds."""
    if not (folder / NAME).exists():
        return 0
    return sum(1 for e in events(folder) if kind is None or e.kind == kind)


def wait_for_moment(launch: Launch, moment: str, chance: random.Random, span: float) -> None:
    if moment == "delay":  # anywhere: the sweep's start, a trial's start, its training, the ledger
        deadline = time.monotonic() + chance.uniform(1.0, 0.3 * span)
        launch.wait_until(lambda: time.monotonic() > deadline, "the moment to kill")
    elif moment == "training":  # while a trial trains: after its start line, within a unit's steps
        launch.wait_until(lambda: "; training to" in launch.text(), "a trial training")
        deadline = time.monotonic() + chance.uniform(0.0, 8 * STEP_SECONDS)
        launch.wait_until(lambda: time.monotonic() > deadline, "the moment to kill")
    else:  # right after the ledger gained a segment's result ("segment_finished") or any event (None)
        kind = moment or None
        seen = recorded(launch.folder, kind)
        launch.wait_until(lambda: recorded(launch.folder, kind) > seen, f"a new {kind or 'event'}")


def assert_no_run_started_over(texts: list[str], before_kill: list[dict[str, bool]], runs: list[str]) -> None:
    for run in runs:
        logged = [starts(text, run) for text in texts]
        for i, had in enumerate(before_kill):  # a run that had committed starts from its checkpoint ever after
            if had.get(run):
                assert "no checkpoint" not in [s for later in logged[i + 1 :] for s in later], (run, i, logged)
        # from nothing once, plus once more for each launch killed before the run had committed anything
        restarted = sum(1 for i, had in enumerate(before_kill) if "no checkpoint" in logged[i] and not had.get(run))
        assert sum(s.count("no checkpoint") for s in logged) == 1 + restarted, (run, logged, before_kill)


def runner_folders(tmp: Path) -> list[str]:
    """What sweeps left in their temporary folder: the warm runners' trial files (tasks/trial_runner.py)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith((FOLDER_PREFIX, "trial-")))


def test_sweep_killed_anywhere_continues_with_no_trial_starting_over(tmp_path, prefect_env, reference):
    """Each kill is a SIGKILL of the sweep alone (``Launch.kill``): its warm runners, idle or training, die with it
    (PR_SET_PDEATHSIG). Its trial folder (<tmp>/sweep-runners-<pid>-*) stays, since nothing of it ran to remove it; the
    next launch removes it, and the last removes its own at its end: nothing of any launch is left in the temporary
    folder (what test_warm_runners.py tested with a kill of its own, merged here: issue 47)."""
    folder, chance, tmp = tmp_path / "runs", random.Random(35), tmp_path / "tmp"
    tmp.mkdir()
    env = {**prefect_env, "TMPDIR": str(tmp)}
    texts: list[str] = []
    before_kill: list[dict[str, bool]] = []  # per killed launch: which runs had a checkpoint when it died
    left: list[Path] = []  # the trial folders the kills left
    # a random moment, one mid-unit, one right after a segment's result, one right after any ledger event (one draw
    # each: a second random "delay" here was a second seed of the first scenario, issue 47)
    moments = ["delay", "training", "segment_finished", ""]
    for i, moment in enumerate(moments):
        launch = Launch(folder, env, tmp_path / f"launch{i}.log")
        try:
            wait_for_moment(launch, moment, chance, reference["seconds"])
            launch.kill()
        finally:
            launch.close()
        texts.append(launch.text())
        runs = [t["run_name"] for t in Study.fold(events(folder)).summary()["trials"]]
        before_kill.append({run: committed(folder, run) is not None for run in runs})
        left += [p for p in tmp.glob(f"{FOLDER_PREFIX}{launch.proc.pid}-*") if list(p.glob("runner-*.json"))]
    assert left, f"no kill left a trial folder of its runners: {runner_folders(tmp)}"  # the mid-unit one does
    texts.append(Launch(folder, env, tmp_path / "last.log").finish())
    assert runner_folders(tmp) == []

    assert summary(folder) == reference["summary"]
    best = best_weights(folder)
    assert best.keys() == reference["best"].keys()
    assert all(torch.equal(best[k], reference["best"][k]) for k in best)
    assert_no_run_started_over(texts, before_kill, [t["run_name"] for t in reference["summary"]["trials"]])
    # each kill costs at most the unit each running trial was in, never a finished unit
    assert units_trained(folder) <= reference["units_trained"] + 2 * len(moments)


def test_a_killed_trial_process_is_retried_and_resumes(tmp_path, prefect_env, reference):
    """The trial's process is a warm runner (the default): SIGKILLed mid-segment, it is replaced by a new runner
    and the segment resumes from its checkpoint (also what test_warm_runners.py tested with a kill of its own)."""
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
    used = WARM.search(text)  # the killed runner was replaced: 7 segments and the retry, in at most 3 runners
    assert used and int(used.group(1)) == 8 and int(used.group(2)) <= 3, text[-3000:]
    assert summary(folder) == reference["summary"]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory, prefect_env) -> dict:
    """A sweep SIGTERMed while its first two trials are mid-unit, then launched again to its end."""
    base = tmp_path_factory.mktemp("preempted")
    folder = base / "runs"
    tmp = base / "tmp"
    tmp.mkdir()
    env = {**prefect_env, "TMPDIR": str(tmp)}
    slow = {"recipe_args": json.dumps({**ARGS, "step_seconds": 1.0})}  # 8 s a unit: both first trials mid-unit
    launch = Launch(folder, env, base / "stopped.log", **slow)
    try:
        # Two trials running, each in its first unit: its TensorBoard folder made (right before its first step) and
        # no checkpoint yet. Counting "fresh initialization" lines was not enough: under load one runner took 70 s to
        # start, the other's trial finished its unit and the next began, and the second line was that one's.
        def two_in_their_first_unit() -> bool:
            running = set(launch.trial_processes().values())
            return len(running) == 2 and all(
                (folder / NAME / run / "tb").is_dir() and committed(folder, run) is None for run in running
            )

        launch.wait_until(two_in_their_first_unit, "two trials in their first unit")
        time.sleep(random.Random(143).uniform(1.0, 3.0))  # a moment within their first unit's steps
        training = set(launch.trial_processes().values())
        assert len(training) == 2 and all(committed(folder, run) is None for run in training), training
        t0 = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)
        code = launch.proc.wait(timeout=GRACE + 30)
        seconds = time.monotonic() - t0
    finally:
        launch.close()
    stopped = {run: committed(folder, run) for run in training}
    left_by_stop = runner_folders(tmp)  # a stopped sweep removes its runners' trial files itself
    again = Launch(folder, env, base / "relaunched.log", **slow).finish()
    return {"folder": folder, "code": code, "seconds": seconds, "text": launch.text(), "again": again,
            "stopped": stopped, "left": [left_by_stop, runner_folders(tmp)]}  # fmt: skip


def test_a_preempted_sweep_commits_and_resumes(preempted, reference):
    text, folder = preempted["text"], preempted["folder"]
    assert preempted["code"] == EXIT_CODE and preempted["seconds"] < GRACE, (preempted["seconds"], text[-3000:])
    ours = [line for line in text.splitlines() if line.startswith("error: ") and not TRIAL_ERROR.match(line)]
    assert len(ours) == 1 and ours[0].startswith(f"error: sweep '{NAME}' preempted by SIGTERM"), text[-3000:]
    assert "run the same command again" in ours[0]
    for run, progress in preempted["stopped"].items():  # each stopped where it stood and committed that step
        stopped = re.search(rf"error: run '{run}' .*?: stopped at step (\d+); checkpoint", text)
        assert stopped, text[-3000:]
        assert progress is not None and progress["step"] == int(stopped.group(1)) > 0
        assert starts(text, run) == ["no checkpoint"] and "no checkpoint" not in starts(preempted["again"], run)
    assert preempted["left"] == [[], []]  # nothing of the stopped sweep or its relaunch in the temporary folder
    assert summary(folder) == reference["summary"]  # the units' train_loss and samples too: the resumed units go on
