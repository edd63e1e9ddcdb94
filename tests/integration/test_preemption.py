"""Preemption with real processes and real signals: SIGTERM to `python -m flows.train` at random points (start-up,
mid-step, mid-evaluation, mid-commit and mid-upload to S3) and to one rank of a torchrun unit.

Each case asserts what a reclaimed machine needs: the process leaves within the grace period, the relaunch redoes
at most one step (here: none), its final weights are torch.equal to an uninterrupted run's (the same flags through
``tests.run_lifecycle``, without Prefect), ``latest`` verifies, and no process of the killed run is left. The recipe
marks the phase it is in (tests/recipes_for_tests.py's PacedRecipe), so the signal lands in the phase the case names;
where in that phase is random.

Ctrl-C, sent to the command's whole process group as a terminal does: once, a stop like SIGTERM (exit 130, one line,
a committed checkpoint); twice, an abort within seconds (one line, no traceback, the step in progress not saved).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.export import model_weights
from checkpointing.store import STATE_FILE
from deployments.stack import descendants
from tests.conftest import ROOT
from tests.procs import alive
from training.preemption import EXIT_CODE, INTERRUPTED

pytestmark = pytest.mark.slow
PACED = "tests.recipes_for_tests:PacedRecipe"
GRACE = 25.0  # preemption_grace_seconds' default
STEPS = 16
ARGS = {"num_samples": 256, "hidden": 1024, "num_layers": 3, "step_seconds": 0.1, "eval_seconds": 0.3}


def command(folder: str, record: Path, run_name: str, **options) -> list[str]:
    flags = {
        "run_name": run_name,
        "save_folder": folder,
        "recipe": PACED,
        "recipe_args": json.dumps({**ARGS, "record_dir": str(record)}),
        "max_duration": f"{STEPS}ba",
        "save_interval": "4ba",
        "eval_interval": "6ba",
        "global_batch_size": 32,
        "seed": 7,
        "unit_retries": 0,
        **options,
    }
    return [sys.executable, "-m", "flows.train", *(a for k, v in flags.items() for a in (f"--{k}", str(v)))]


class Launch:
    """One `python -m flows.train` process, its log, and every process it started (seen while it ran)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, terminal: bool = False):
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - the child writes it until it exits
        # terminal: a process group of its own, as a shell gives a command, so that a test can Ctrl-C that group
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=terminal
        )
        self.children: set[int] = set()

    def watch(self) -> None:
        self.children.update(descendants(self.proc.pid))

    def text(self) -> str:
        return self.log.read_text()

    def wait_until(self, predicate, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self.watch()
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def terminate(self) -> tuple[int, float]:
        """SIGTERM, then the exit code and the seconds it took to exit."""
        self.watch()
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=GRACE + 30)
        return code, time.monotonic() - t0

    def leftovers(self) -> list[int]:
        time.sleep(0.5)
        return [pid for pid in self.children if alive(pid)]


def phase(record: Path) -> str:
    try:
        return (record / "phase").read_text().split()[0]
    except (OSError, IndexError):
        return ""


def model_of(folder: str, run_name: str, options: dict | None = None) -> dict[str, torch.Tensor]:
    store = CheckpointStore(folder, run_name, storage_options=options)
    info = store.latest(deep=True)
    assert info is not None
    return store.load(info, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]


def steps_trained(record: Path, rank: int = 0) -> int:
    return len((record / f"ids-rank{rank}.txt").read_text().splitlines())


def complete(cmd: list[str], env: dict[str, str], log: Path) -> str:
    launch = Launch(cmd, env, log)
    assert launch.proc.wait(timeout=300) == 0, launch.text()[-3000:]
    return launch.text()


def uninterrupted(cmd: list[str], env: dict[str, str], log: Path) -> str:
    """``cmd`` (a ``python -m flows.train`` command) run to its end without Prefect (``tests.run_lifecycle``, the same
    flags): a reference only, where the flow is not what is tested (issue 47: a flow launch costs its flow and task
    runs on the server; the killed and relaunched runs it is compared with go through the flow)."""
    return complete([*cmd[:2], "tests.run_lifecycle", *cmd[3:]], env, log)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_env) -> dict[str, torch.Tensor]:
    base = tmp_path_factory.mktemp("reference")
    uninterrupted(command(str(base / "runs"), base / "ids", "p"), prefect_env, base / "log")
    return model_of(str(base / "runs"), "p")


def temporary_server_env(prefect_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in prefect_env.items() if k != "PREFECT_API_URL"}


@pytest.mark.parametrize("when", ["start-up", "mid-step", "mid-eval", "mid-commit"])
def test_sigterm_at_any_point_costs_no_step_and_the_relaunch_is_bit_identical(when, tmp_path, prefect_env, reference):
    folder, record = str(tmp_path / "runs"), tmp_path / "ids"
    run_name = f"p-{when}-{os.getpid()}"  # the flow run's name too: one of its own on the session's server
    cmd = command(folder, record, run_name)
    env = temporary_server_env(prefect_env) if when == "start-up" else prefect_env
    launch = Launch(cmd, env, tmp_path / "killed.log")
    chance = random.Random(f"{when}-{os.getpid()}")
    if when == "start-up":  # imports, the temporary Prefect server's start, the flow's start
        time.sleep(chance.uniform(0.3, 3.0))
    elif when == "mid-step":
        launch.wait_until(lambda: Path(folder, run_name, "latest").exists() and phase(record) == "step", "a step")
        time.sleep(chance.uniform(0.0, ARGS["step_seconds"]))
    elif when == "mid-eval":
        launch.wait_until(lambda: phase(record) == "eval", "an evaluation")
        time.sleep(chance.uniform(0.0, 3 * ARGS["eval_seconds"]))
    else:  # the second unit's checkpoint is being written (19 MB of state)
        launch.wait_until(lambda: launch.text().count("writing checkpoint") >= 2, "a commit")

    code, seconds = launch.terminate()

    if when == "start-up":  # -15: the signal came before Python had imported the handler
        assert code in (EXIT_CODE, -signal.SIGTERM), launch.text()[-3000:]
    else:
        out = launch.text()
        assert code == EXIT_CODE, out[-3000:]
        # Prefect's engine shows a BaseException as a crash (two ERROR lines, "Crash detected!", Crashed): a polite
        # stop must read as what it was, one line, and a flow run Cancelled, named Preempted
        errors = error_lines(out)
        assert len(errors) == 1 and "preempted by SIGTERM: stopped at step" in errors[0], out[-3000:]
        assert "Crash" not in out and " ERROR " not in out and "| ERROR" not in out, out[-3000:]
        assert flow_run_state(run_name) == ("CANCELLED", "Preempted", True)
        store = CheckpointStore(folder, run_name)
        assert store.check(store.latest(), deep=True) == []  # the preemption checkpoint verifies
    assert seconds < GRACE, f"left {seconds:.1f} s after SIGTERM"
    assert launch.leftovers() == [], "processes of the preempted run are still running"
    before = steps_trained(record) if (record / "ids-rank0.txt").exists() else 0

    complete(cmd, prefect_env, tmp_path / "relaunched.log")

    assert steps_trained(record) - STEPS <= 1, f"{steps_trained(record) - STEPS} step(s) trained again"
    assert steps_trained(record) >= STEPS and before <= STEPS
    got = model_of(folder, run_name)
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def flow_run_state(run_name: str) -> tuple[str, str, bool]:
    """The type and name of the first flow run named ``run_name``, and whether its message says where it stopped."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        first = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name])),
                                      sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1)[0]  # fmt: skip
    return first.state.type.value, first.state.name, "stopped at step" in (first.state.message or "")


def test_sigterm_while_the_previous_checkpoint_uploads_to_s3_finishes_it_then_commits_and_resumes(
    tmp_path, prefect_env, reference, s3
):
    folder, options = s3
    record = tmp_path / "ids"
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # the moto server's fake credentials
    env = {**prefect_env, **aws, "TRAIN_STORAGE_OPTIONS": json.dumps(options)}
    cmd = command(folder, record, "p", async_upload="true")
    launch = Launch(cmd, env, tmp_path / "killed.log")
    launch.wait_until(lambda: "handed to the upload after" in launch.text(), "a background upload")

    code, seconds = launch.terminate()

    assert code == EXIT_CODE, launch.text()[-3000:]
    assert seconds < GRACE
    assert launch.leftovers() == []
    store = CheckpointStore(folder, "p", storage_options=options)
    names = [i.name for i in store.list()]
    assert "ep0-ba4-sa128" in names  # the upload in flight was finished before leaving
    assert store.check(store.latest(), deep=True) == []
    complete(cmd, env, tmp_path / "relaunched.log")
    assert steps_trained(record) - STEPS <= 1
    got = model_of(folder, "p", options)
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def rank_pid(launch: Launch, rank: int) -> int | None:
    for pid in descendants(launch.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        is_rank = b"training.distributed.rank" in cmdline and b"torch.distributed.run" not in cmdline
        if is_rank and f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(tmp_path, prefect_env, parallelism):
    folder, record = str(tmp_path / "runs"), tmp_path / "ids"
    ref_folder, ref_record = str(tmp_path / "ref"), tmp_path / "ref-ids"
    options = {"nproc_per_node": 2, "parallelism": parallelism}
    uninterrupted(command(ref_folder, ref_record, "p", **options), prefect_env, tmp_path / "ref.log")
    cmd = command(folder, record, "p", **options)
    launch = Launch(cmd, prefect_env, tmp_path / "killed.log")
    launch.wait_until(lambda: Path(folder, "p", "latest").exists() and phase(record) == "step", "a step")
    victim = rank_pid(launch, rank=1)
    assert victim is not None
    launch.watch()
    os.kill(victim, signal.SIGTERM)  # the signal reaches one rank only (Slurm's --signal may, for one)
    code = launch.proc.wait(timeout=GRACE + 30)

    assert code == EXIT_CODE, launch.text()[-3000:]
    assert launch.leftovers() == []
    assert steps_trained(record, 0) == steps_trained(record, 1)  # both ranks stopped after the same step
    info = CheckpointStore(folder, "p").latest(deep=True)
    assert info.progress["step"] == steps_trained(record, 0) and info.manifest.metadata["world_size"] == 2
    complete(cmd, prefect_env, tmp_path / "relaunched.log")
    assert steps_trained(record, 0) == STEPS and steps_trained(record, 1) == STEPS  # nothing trained twice
    # the model of the last checkpoint, one state.pt (DDP) or every rank's DCP shards consolidated (FSDP)
    got, _ = model_weights(str(Path(folder, "p")), None)
    want, _ = model_weights(str(Path(ref_folder, "p")), None)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def inside_a_unit(folder: str, record: Path) -> bool:
    """In the first or second step of a unit after the first (4 steps each): a stop lands inside the unit."""
    return Path(folder, "p", "latest").exists() and phase(record) == "step" and steps_trained(record) % 4 in (1, 2)


def test_ctrl_c_stops_like_sigterm_one_line_exit_130_and_a_committed_checkpoint(tmp_path, prefect_env):
    """At a terminal, without a Prefect server: Ctrl-C reaches the command's whole process group."""
    folder, record = str(tmp_path / "runs"), tmp_path / "ids"
    env = temporary_server_env(prefect_env)
    launch = Launch(command(folder, record, "p"), env, tmp_path / "interrupted.log", terminal=True)
    launch.wait_until(lambda: inside_a_unit(folder, record), "a step inside a unit")
    launch.watch()

    os.killpg(launch.proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal sends

    code = launch.proc.wait(timeout=GRACE + 30)
    out = launch.text()
    assert code == INTERRUPTED, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert len(error_lines(out)) == 1 and "interrupted by Ctrl-C (SIGINT): stopped at step" in error_lines(out)[0]
    assert "| ERROR" not in out, out[-3000:]  # the stopped unit's task run ends INFO (tasks/stopped_log.py)
    store = CheckpointStore(folder, "p")
    info = store.latest(deep=True)
    assert info.progress["step"] == steps_trained(record) and info.progress["step"] % 4 != 0  # at that step, mid-unit
    assert store.check(info, deep=True) == []
    assert launch.leftovers() == []


def test_a_second_ctrl_c_aborts_at_once_with_one_line(tmp_path, prefect_env):
    folder, record = str(tmp_path / "runs"), tmp_path / "ids"
    slow = json.dumps({**ARGS, "step_seconds": 6.0, "record_dir": str(record)})  # a step a person will not wait for
    cmd = command(folder, record, "p", recipe_args=slow, save_interval="1ba")
    launch = Launch(cmd, prefect_env, tmp_path / "aborted.log", terminal=True)
    launch.wait_until(lambda: Path(folder, "p", "latest").exists() and phase(record) == "step", "a step")
    step = steps_trained(record)
    launch.wait_until(lambda: steps_trained(record) > step, "the start of the next step")
    launch.watch()

    os.killpg(launch.proc.pid, signal.SIGINT)  # a stop at the end of this step, 6 s from now ...
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(launch.proc.pid, signal.SIGINT)  # ... is too long to wait: Ctrl-C again

    code = launch.proc.wait(timeout=GRACE + 30)
    seconds = time.monotonic() - t0
    out = launch.text()
    assert code == INTERRUPTED, out[-3000:]
    assert seconds < 4.0, f"left {seconds:.1f} s after the second Ctrl-C"  # the step would have ended at ~5.5 s
    assert "Traceback" not in out, out[-3000:]
    assert len(error_lines(out)) == 1 and "aborted by Ctrl-C" in error_lines(out)[0], out[-3000:]
    store = CheckpointStore(folder, "p")
    info = store.latest(deep=True)
    assert info.progress["step"] == step and store.check(info, deep=True) == []  # the step it left was not saved
    assert launch.leftovers() == []
