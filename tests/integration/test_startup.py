"""How `python -m flows.train` and `train()` start and end: the temporary Prefect server overlaps the imports, the
answers that need nothing come before anything is imported or started, and no server outlives its process.

No timing is asserted here (bench/startup.py measures it): what is asserted is the order of things and what is
left running.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.server import free_port
from tests import deadlines
from tests.conftest import ROOT, TEST_RECIPES
from tests.procs import alive, children, cmdline

pytestmark = pytest.mark.slow
SERVER_LINE = re.compile(r"starting a temporary Prefect server on http://127\.0\.0\.1:(\d+)/api")


def bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No PREFECT_API_URL and nothing on PREFECT_PORT: whatever needs a server must start one itself. Output
    buffered as in a pipeline (``python -m flows.train | tee log``), whatever this process was given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRAIN_")) and k != "PYTHONUNBUFFERED"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_PORT=str(free_port()), PYTHONPATH=str(ROOT),
               TRAIN_ALLOWED_RECIPES=TEST_RECIPES, **extra)  # fmt: skip
    return env


def imported(importtime_stderr: str) -> set[str]:
    """Top-level packages a `python -X importtime` run imported."""
    lines = [line for line in importtime_stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines[1:]}


def imported_at(importtime_stderr: str, package: str) -> int:
    """Where in a `python -X importtime` run's stderr ``package`` finished importing."""
    m = re.search(rf"^import time:[^|]*\|[^|]*\|\s+{re.escape(package)}$", importtime_stderr, re.MULTILINE)
    assert m, f"{package} was not imported"
    return m.start()


def server_processes(port: str) -> list[int]:
    """Processes running `python -m flows.server <port>` (our temporary server on that port)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flows.server" in argv and port.encode() in argv and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def listening(port: str) -> bool:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def flows_train(tmp_path: Path, *args: str, importtime: bool = False, timeout: float = 300, module="flows.train"):
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, env=bare_env(tmp_path), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("module", "own_flag"), [("flows.train", "--max_duration"), ("flows.retrain", "--metric")])
def test_help_answers_without_importing_torch_or_prefect_or_starting_a_server(tmp_path, module, own_flag):
    done = flows_train(tmp_path, "--help", importtime=True, timeout=60, module=module)

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: python -m {module}")
    assert own_flag in done.stdout and "--save_folder" in done.stdout
    assert not imported(done.stderr) & {"torch", "prefect", "numpy"}
    assert not SERVER_LINE.search(done.stderr)


def test_a_flag_mistake_is_one_line_before_torch_imports_and_starts_nothing(tmp_path):
    done = flows_train(tmp_path, "--max_duration", "3x", "--save_folder", str(tmp_path / "runs"), importtime=True)

    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == [errors[0]] and errors[0].startswith("error: max_duration='3x': use '<n>ep'"), errors
    assert not imported(done.stderr) & {"torch", "prefect"}
    assert not SERVER_LINE.search(done.stderr)
    assert not (tmp_path / "runs").exists()


def test_a_recipe_mistake_found_by_the_preflight_stops_the_server_started_meanwhile(tmp_path):
    done = flows_train(tmp_path, "--recipe", "synthetic", "--recipe_args", '{"num_layers": 0}',
                       "--save_folder", str(tmp_path / "runs"), importtime=True)  # fmt: skip

    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    started = SERVER_LINE.search(done.stderr)
    assert started, "the server was not started before the pre-flight"
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]], lines  # one line for the mistake, the last one
    assert errors[0].startswith("error: recipe_args={'num_layers': 0}: SyntheticRecipe rejected them"), lines
    before_torch = started.start() < imported_at(done.stderr, "torch")
    assert before_torch, "the server was started only after torch had been imported"
    port = started.group(1)
    assert gone_within(server_processes(port), 5), "the temporary server outlived the command"
    assert not listening(port)


def test_a_run_adopts_the_server_it_started_before_its_imports(tmp_path):
    done = flows_train(tmp_path, "--recipe", "synthetic", "--max_duration", "1ep",
                       "--save_folder", str(tmp_path / "runs"), importtime=True)  # fmt: skip

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("run default complete: epoch 1, step 8, 512 samples")
    starts = SERVER_LINE.findall(done.stderr)
    assert len(starts) == 1, f"{len(starts)} servers started"  # the early one was used, not a second one
    started = SERVER_LINE.search(done.stderr)
    assert started is not None and started.start() < imported_at(done.stderr, "torch")
    assert "Error logging to API" not in done.stdout + done.stderr
    assert gone_within(server_processes(starts[0]), 5)


TRAIN_FROM_PYTHON = textwrap.dedent(
    """
    import sys
    from flows.train import TrainConfig, train
    result = train(TrainConfig(recipe="synthetic", max_duration=sys.argv[2], save_folder=sys.argv[1]))
    print("result", result.epoch)
    """
)


def start_python_train(tmp_path: Path, max_duration: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN_FROM_PYTHON, str(tmp_path / "runs"), max_duration],
                            cwd=ROOT, env=bare_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def test_train_from_python_leaves_no_server_running_after_a_sigkill(tmp_path):
    proc = start_python_train(tmp_path, "200ep")
    assert proc.stdout is not None
    deadline = deadlines.deadline(180)
    for line in proc.stdout:
        if "unit 0 (attempt 1)" in line:  # training: the server is up and in use
            break
        assert time.monotonic() < deadline, "the run never started"
    servers = children(proc.pid)
    assert servers, "no server child found"

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    assert gone_within(servers, 5), f"server process(es) {servers} outlived the killed train() caller"


def test_train_from_python_waits_for_a_server_slower_than_prefects_own_timeout(tmp_path):
    """Prefect's own temporary server gives up after 20 s (it did at load ~15); ours is waited for while it lives.
    The server is frozen (SIGSTOP) for 25 s before it can answer, as a loaded machine would delay it."""
    proc = start_python_train(tmp_path, "1ep")
    deadline = deadlines.deadline(120)
    while not (servers := [pid for pid in children(proc.pid) if b"flows.server" in cmdline(pid)]):
        assert proc.poll() is None and time.monotonic() < deadline, "no server child appeared"
        time.sleep(0.02)
    os.kill(servers[0], signal.SIGSTOP)
    try:
        time.sleep(25)
    finally:
        os.kill(servers[0], signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)

    assert proc.returncode == 0, out[-3000:]
    assert "result 1" in out
    assert "still starting the temporary Prefect server" in out  # it said why it waited
    assert gone_within(servers, 5)


def test_a_flow_run_still_sends_heartbeats_and_ends_without_waiting_on_their_thread(prefect_harness, tmp_path):
    """flows/heartbeat.py: the heartbeat thread that the reconciler relies on still reports to the server,
    and is stopped and joined when the flow returns (without the second-long sleep Prefect 3.8's has)."""
    import threading
    import uuid

    import prefect.flow_engine
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.schemas.events import ResourceSpecification

    from flows import heartbeat
    from flows.train import TrainConfig, train

    name = f"hb-{uuid.uuid4().hex[:8]}"
    train(TrainConfig(run_name=name, recipe="synthetic", max_duration="1ep", save_folder=str(tmp_path / "runs")))

    assert prefect.flow_engine._send_heartbeats is heartbeat.send_heartbeats  # installed by train()'s API set-up
    assert not [t for t in threading.enumerate() if t.name == heartbeat.THREAD_NAME]  # stopped and joined
    wanted = EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
        resource=EventResourceFilter(labels=ResourceSpecification({"prefect.resource.name": name})),
    )
    deadline = time.monotonic() + 60  # the server persists events in batches
    with get_client(sync_client=True) as client:
        while not (beats := client.read_events(filter=wanted, limit=10).events) and time.monotonic() < deadline:
            time.sleep(1)
    assert beats, "no heartbeat of the flow run reached the server"
