"""`python -m flows.train` as a person runs it: one line per error, and nothing left running after it dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.server import free_port
from tests import deadlines
from tests.conftest import ROOT, TEST_RECIPES
from tests.procs import alive, children

pytestmark = pytest.mark.slow


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No PREFECT_API_URL and no server on PREFECT_PORT: the command must start a temporary server itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRAIN_"))}
    free = free_port()
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_PORT=str(free), PYTHONPATH=str(ROOT),
               TRAIN_ALLOWED_RECIPES=TEST_RECIPES, **extra)  # fmt: skip
    return env


def test_a_killed_cli_leaves_no_prefect_server_behind(tmp_path):
    env = cli_env(tmp_path)
    args = ["--save_folder", str(tmp_path / "runs"), "--recipe", "synthetic", "--max_duration", "200ep"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = None
    deadline = deadlines.deadline(180)
    for line in proc.stdout:
        url = url or (re.search(r"temporary Prefect server on (http://\S+)", line) or [None, None])[1]
        if "unit 0 (attempt 1)" in line:  # training: the server is up and in use
            break
        assert time.monotonic() < deadline, "the run never started"
    assert url is not None, "the command did not say which server it started"
    servers = children(proc.pid)
    assert servers, "no server child found"
    environ = Path(f"/proc/{servers[0]}/environ").read_bytes().split(b"\0")
    assert b"PREFECT_SERVER_ANALYTICS_ENABLED=false" in environ  # offline machines: no telemetry errors

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    deadline = time.monotonic() + 5  # "nothing the product starts may outlive it by more than a few seconds"
    while any(alive(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in servers), f"server process(es) {servers} outlived the killed command"


def test_a_runtime_error_is_one_line_at_the_terminal_and_a_traceback_with_verbose(tmp_path, prefect_env):
    base = [sys.executable, "-m", "flows.train", "--save_folder", str(tmp_path / "runs"), "--recipe", "synthetic",
            "--max_duration", "2ep", "--inject_fault_at_step", "3", "--unit_retries", "0"]  # fmt: skip

    quiet = subprocess.run(base, cwd=ROOT, env=prefect_env, capture_output=True, text=True, timeout=300)
    verbose = subprocess.run([*base, "--verbose"], cwd=ROOT, env=prefect_env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip

    assert quiet.returncode == 1
    assert "Traceback" not in quiet.stderr, quiet.stderr[-3000:]
    last = quiet.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run 'default' did not complete: InjectedFault: injected fault after step 3")
    assert "--verbose prints it here" in last
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_a_run_on_a_temporary_server_ends_with_its_result_not_log_shipping_errors(tmp_path):
    """The flow's last log lines are shipped to the temporary server before it stops: drained at interpreter
    exit they met a closed port and printed 'Error logging to API' after the result."""
    done = subprocess.run(
        [sys.executable, "-m", "flows.train", "--recipe", "synthetic", "--max_duration", "1ep",
         "--save_folder", str(tmp_path / "runs")],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Error logging to API" not in done.stdout + done.stderr
    # The temporary server has no UI: no link to a page that answers 404, but where a UI can be had.
    assert "View at http" not in done.stdout + done.stderr and "no Prefect UI for this run" in done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("run default complete: epoch 1, step 8, 512 samples; eval_loss ")
    suggested = last.rsplit("(list them: ", 1)[1].rstrip(")")
    assert suggested.endswith(f" -m checkpointing ls {tmp_path / 'runs' / 'default'}")
    # The follow-up works as printed, in the same folder, with no virtual environment activated.
    plain = {k: v for k, v in cli_env(tmp_path).items() if k != "VIRTUAL_ENV"}
    plain["PATH"] = "/usr/bin:/bin"
    listed = subprocess.run(suggested.split(), env=plain, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "ep1-ba8-sa512" in listed.stdout
