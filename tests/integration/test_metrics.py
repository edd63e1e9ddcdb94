"""Metrics of a run in a real process that is really SIGKILLed mid-unit, after it logged steps past its last
checkpoint, and relaunched with the same command: TensorBoard's reading of the event files and a real ``mlflow
server``'s history (SQLite backend) each hold every step once, with an uninterrupted run's values, in one MLflow
run. And the progress bar: drawn on a terminal (a pty), absent when the output is a pipe."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from tests import deadlines
from tests.conftest import ROOT
from tests.unit.test_metrics_log import purge_steps, scalars

pytestmark = pytest.mark.slow
PACED = "tests.recipes_for_tests:PacedRecipe"
STEPS = 24  # 3 epochs of 8 steps, a unit per epoch
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor moves of a terminal


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on a free loopback port, its store in SQLite."""
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(folder / "server.log", "w")  # noqa: SIM115 - the server writes it until it stops
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
         "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # else it leaves a folder in /dev/shm
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = deadlines.deadline(180)
        while True:
            assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not start in 180 s x load (TEST_TIME_SCALE)"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def command(folder: Path, run_name: str, experiment: str) -> list[str]:
    args = {"record_dir": str(folder.parent / f"{run_name}-record"), "step_seconds": 0.1, "num_samples": 256}
    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", run_name, "--save_folder", str(folder),
        "--recipe", PACED, "--recipe_args", json.dumps(args), "--max_duration", "3ep", "--save_interval", "1ep",
        "--global_batch_size", "32", "--seed", "7", "--log_every_n_steps", "1", "--mlflow_experiment", experiment,
    ]  # fmt: skip


def launch(cmd: list[str], env: dict, log: Path, kill_at_line: str | None = None) -> None:
    """Runs ``cmd`` to its end, or SIGKILLs its process group once its output holds ``kill_at_line``."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = deadlines.deadline(300)
        while kill_at_line is not None and time.monotonic() < deadline:
            if kill_at_line in log.read_text():
                os.killpg(proc.pid, signal.SIGKILL)
                break
            assert proc.poll() is None, "the run ended before the kill point:\n" + log.read_text()[-3000:]
            time.sleep(0.01)
        code = proc.wait(timeout=300)
    if kill_at_line is None:
        assert code == 0, log.read_text()[-4000:]
    else:
        assert code == -signal.SIGKILL


def latest_step(run_folder: Path) -> int:
    name = json.loads((run_folder / "latest").read_text())["name"]
    return int(name.split("-ba")[1].split("-")[0])


def test_sigkill_mid_unit_then_relaunch_shows_one_curve_in_tensorboard_and_mlflow(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": mlflow_server}
    experiment = f"metrics-{tmp_path.name}"
    folder = tmp_path / "runs"
    launch(command(folder, "reference", experiment), env, tmp_path / "reference.log")

    # killed in unit 1 once step 12 was logged (and flushed: log_every_n_steps=1); its checkpoint is at step 8
    launch(command(folder, "m", experiment), env, tmp_path / "killed.log", kill_at_line="unit 1: step 12,")
    assert latest_step(folder / "m") == 8, "killed too late to test anything"
    logged_by_killed = [s for s, _ in scalars(folder / "m" / "tb")]
    assert max(logged_by_killed) >= 12  # steps past the checkpoint: the relaunch trains them again
    launch(command(folder, "m", experiment), env, tmp_path / "relaunched.log")
    log = (tmp_path / "relaunched.log").read_text()
    assert re.search(r"unit 1 \(attempt 1\): starting from checkpoint ep1-ba8-sa256", log), log[-3000:]

    # TensorBoard: each step once, strictly increasing, the uninterrupted run's values
    tb = folder / "m" / "tb"
    assert [s for s, _ in scalars(tb)] == list(range(1, STEPS + 1))
    assert scalars(tb) == scalars(folder / "reference" / "tb")
    assert scalars(tb, "train/lr") == scalars(folder / "reference" / "tb", "train/lr")
    assert 9 in purge_steps(tb)  # the relaunch's file drops what the killed attempt logged after step 8

    # MLflow: the relaunch continued the same run; each step once, the uninterrupted run's values
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(r.info.run_name for r in runs) == ["m", "reference"]  # one MLflow run per training run
    run = by_name["m"]
    assert json.loads((folder / "m" / "mlflow.json").read_text())["run_id"] == run.info.run_id
    history = client.get_metric_history(run.info.run_id, "train/loss")
    reference = client.get_metric_history(by_name["reference"].info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, STEPS + 1))
    assert [(m.step, m.value) for m in history] == [(m.step, m.value) for m in reference]
    assert [m.value for m in history] == pytest.approx([v for _, v in scalars(tb)], rel=1e-6)  # TB keeps float32
    assert run.info.status == "FINISHED"
    assert run.data.params["max_duration"] == "3ep" and "storage_options" not in run.data.params
    checkpoints = {k: v for k, v in run.data.tags.items() if k.startswith("checkpoint.")}
    assert sorted(checkpoints) == ["checkpoint.ep1-ba8-sa256", "checkpoint.ep2-ba16-sa512", "checkpoint.ep3-ba24-sa768"]
    assert run.data.tags["latest_checkpoint"] == checkpoints["checkpoint.ep3-ba24-sa768"]
    assert checkpoints["checkpoint.ep3-ba24-sa768"].endswith("/m/checkpoints/ep3-ba24-sa768")


def run_with_output(cmd: list[str], tty: bool) -> str:
    """Runs ``cmd`` with stdout and stderr on a pty (a terminal) or a pipe; returns what it printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "120"}
    env.pop("PREFECT__FLOW_RUN_ID", None)
    if not tty:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr
    primary, replica = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=replica, stderr=replica)
    os.close(replica)
    chunks: list[bytes] = []
    while True:
        ready, _, _ = select.select([primary], [], [], 1.0)
        if ready:
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(primary)
    assert proc.wait(timeout=60) == 0, b"".join(chunks)[-3000:]
    return ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def test_the_progress_bar_draws_on_a_terminal_and_not_in_a_pipe(tmp_path):
    def cmd(name: str, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "tests.run_lifecycle", "--run_name", name, "--save_folder", str(tmp_path / "runs"),
            "--recipe", "recipes.synthetic:SyntheticRecipe", "--recipe_args", '{"num_samples": 256}',
            "--max_duration", "3ep", "--save_interval", "1ep", "--global_batch_size", "32", "--seed", "7", *extra,
        ]  # fmt: skip

    on_terminal = run_with_output(cmd("tty"), tty=True)
    assert re.search(r"step\s+24/24", on_terminal) and "loss 0." in on_terminal, on_terminal[-3000:]
    in_pipe = run_with_output(cmd("pipe"), tty=False)
    assert "run pipe complete" in in_pipe and not re.search(r"step\s+\d+/24", in_pipe), in_pipe[-3000:]
    switched_off = run_with_output(cmd("off", "--progress_bar", "false"), tty=True)
    assert "run off complete" in switched_off and not re.search(r"step\s+\d+/24", switched_off)


def test_two_processes_write_one_curve_from_rank_0_only(make_config, train_run, tmp_path):
    from training.metrics import log as metrics_log

    train_run(make_config(max_duration="2ep", nproc_per_node=2))
    metrics_log.close_all()
    tb = tmp_path / "runs" / "r" / "tb"
    tags_by_writer: dict[str, set[str]] = {}  # pid (events.out.tfevents.<time>.<host>.<pid>.<n>) -> its tags
    for path in tb.glob("events.out.tfevents.*"):
        tags = {v.tag for event in EventFileLoader(str(path)).Load() for v in event.summary.value}
        tags_by_writer.setdefault(path.name.rsplit(".", 2)[1], set()).update(tags)
    # the ranks' steps come from one process (rank 0); the run's final evaluation is this process's (the flow's)
    final = tags_by_writer.pop(str(os.getpid()), set())
    assert final == {"eval/loss", "eval/accuracy"}, final
    assert len(tags_by_writer) == 1, tags_by_writer  # rank 1 wrote nothing
    assert "train/loss" in next(iter(tags_by_writer.values()))
    assert [s for s, _ in scalars(tb)] == list(range(1, 17))
    assert [s for s, _ in scalars(tb, "eval/loss")] == [16]
