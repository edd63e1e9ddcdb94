"""A real Prefect stack for the deployment tests: `prefect server` (SQLite in a temp PREFECT_HOME), the
project's work pool, deployments (deployments/prefect.yaml, through `prefect deploy`), automations and a
process worker. One per test module; every process it started is gone when the module ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from deployments import stack as stacks
from flows.server import free_port
from tests.conftest import ROOT, TEST_RECIPES

# Runs must notice a dead machine within a test's patience: Prefect's floor for the heartbeat is 30 s
# (prefect.yaml sets 30); 60 s of silence (2 heartbeats) marks a run Crashed.
HEARTBEAT_WITHIN_SECONDS = 60


class RunningStack:
    """The stack's processes, the environment to talk to it, and the worker, which a test may kill and replace."""

    def __init__(self, home: Path, logs: Path, allowed_root: Path):
        self.logs = logs
        self.stack = stacks.Stack(
            home=home,
            port=free_port(),
            extra_env={
                "PYTHONPATH": str(ROOT),  # flow-run processes import the tests' recipes
                "TRAIN_ALLOWED_RECIPES": TEST_RECIPES,  # ... which the worker allows, as a real worker would
                "TRAIN_ALLOWED_ROOTS": str(allowed_root),  # where runs may read and write: this session's tmp folders
                "EVIL_MARKER": str(logs / "evil-module-was-imported"),  # tests/evil_recipe.py writes it on import
                "PREFECT_LOGGING_LEVEL": "INFO",  # flow-run logs reach the API, where tests read them
                "PREFECT_WORKER_QUERY_SECONDS": "1",
                "PREFECT_LOGGING_SERVER_LEVEL": "INFO",  # server.log shows which events each automation saw
            },
        )
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.started: list[subprocess.Popen] = []

    @property
    def api_url(self) -> str:
        return self.stack.api_url

    def env(self) -> dict[str, str]:
        return self.stack.env()

    def up(self) -> None:
        self.server = self._track(stacks.start_server(self.stack, self.logs / "server.log"))
        stacks.wait_healthy(self.stack, self.server)
        stacks.create_pool(self.stack)
        stacks.deploy(self.stack)
        stacks.install_automations(self.stack, "--within", str(HEARTBEAT_WITHIN_SECONDS))
        self.start_worker()

    def start_worker(self) -> subprocess.Popen:
        self.worker = self._track(stacks.start_worker(self.stack, self.logs / f"worker-{len(self.started)}.log"))
        return self.worker

    def kill_worker_machine(self) -> list[int]:
        """SIGKILLs the worker and every process below it at once: nothing is left to report anything."""
        pids = [self.worker.pid, *stacks.descendants(self.worker.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        self.worker.wait(timeout=30)
        return pids

    def down(self) -> list[int]:
        """Stops everything started here; returns the pids of any process that survived (should be none)."""
        tree = [p for proc in self.started for p in [proc.pid, *stacks.descendants(proc.pid)]]
        for proc in reversed(self.started):
            stacks.stop(proc)
        return [pid for pid in tree if _alive(pid)]

    def _track(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.started.append(proc)
        return proc


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def prefect_stack(tmp_path_factory):
    """Server + pool + deployments + automations + worker, for one test module."""
    logs = tmp_path_factory.mktemp("stack-logs")
    running = RunningStack(home=tmp_path_factory.mktemp("prefect-home"), logs=logs,
                           allowed_root=tmp_path_factory.getbasetemp())  # fmt: skip
    try:
        running.up()
        yield running
    finally:
        survivors = running.down()
        assert not survivors, f"processes left running after the stack stopped: {survivors}"
