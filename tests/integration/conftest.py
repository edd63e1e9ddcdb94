"""A real Prefect stack for the deployment tests: `prefect server`, the project's work pool, deployments
(deployments/prefect.yaml, through `prefect deploy`), the heartbeat window and a process worker. One per pytest process
(xdist worker), shared by the modules on SQLite; one of its own for a module on PostgreSQL or one that sets
``OWN_STACK``. Every process a stack started is gone when it stops (checked).

The server's database is SQLite in a temp PREFECT_HOME, or a PostgreSQL server started for the module (a cluster
in a temp dir, as the stack's `postgres` user when run by root): a module sets ``STACK_DATABASE = "postgres"``
(test_deployments_postgres.py), or TEST_STACK_DATABASE=postgres runs every module on it (`make test-deployments
DB=postgres`). Without PostgreSQL's binaries those modules skip, saying why, unless TEST_REQUIRE_POSTGRES is
set (.ci/run sets it: CI has them, so CI must not skip).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from deployments import postgres
from deployments import stack as stacks
from flows.server import free_port
from tests.conftest import ROOT, TEST_RECIPES
from tests.procs import alive

# Runs must notice a dead machine within a test's patience: Prefect's floor for the heartbeat is 30 s
# (prefect.yaml sets 30); 60 s of silence (2 heartbeats) marks a run Crashed.
HEARTBEAT_WITHIN_SECONDS = 60
# A stopped worker waits this long for its flow runs to preempt themselves (a few seconds here); a test's run that
# never reaches a step boundary (a paused recipe) would hold each stop for the worker's default of 60 s.
WORKER_STOP_SECONDS = 15.0


class RunningStack:
    """The stack's processes, the environment to talk to it, and the worker, which a test may kill and replace."""

    def __init__(self, home: Path, logs: Path, allowed_root: Path, database: str = "sqlite"):
        self.logs = logs
        self.database = database
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
                "PREFECT_LOGGING_SERVER_LEVEL": "INFO",  # server.log shows what the server did with each event
            },
        )
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.started: list[subprocess.Popen] = []
        self.postgres: postgres.LocalPostgres | None = None
        self.postgres_server: subprocess.Popen | None = None

    @property
    def api_url(self) -> str:
        return self.stack.api_url

    def env(self) -> dict[str, str]:
        return self.stack.env()

    def up(self) -> None:
        if self.database == "postgres":
            port = free_port()
            while port == self.stack.port:  # the server's port is chosen early and not bound yet: never share it
                port = free_port()
            self.postgres = postgres.LocalPostgres(postgres.temporary_folder(), port, durable=False)
            self.postgres_server = self._track(self.postgres.start(self.logs / "postgres.log"))
            self.postgres.wait_ready(self.postgres_server)
            self.stack.database_url = self.postgres.url
        self.server = self._track(stacks.start_server(self.stack, self.logs / "server.log"))
        stacks.wait_healthy(self.stack, self.server)
        stacks.create_pool(self.stack)
        stacks.deploy(self.stack)
        stacks.install_automations(self.stack, "--within", str(HEARTBEAT_WITHIN_SECONDS))
        self.start_worker()

    def start_worker(self) -> subprocess.Popen:
        log = self.logs / f"worker-{len(self.started)}.log"
        self.worker = self._track(stacks.start_worker(self.stack, log, stop_seconds=WORKER_STOP_SECONDS))
        return self.worker

    def kill_worker_machine(self) -> list[int]:
        """SIGKILLs the worker and every process below it at once: nothing is left to report anything."""
        assert self.worker is not None, "no worker was started"
        pids = [self.worker.pid, *stacks.descendants(self.worker.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        self.worker.wait(timeout=30)
        return pids

    def down(self) -> list[int]:
        """Stops everything started here; returns the pids of any process that survived (should be none)."""
        tree = [p for proc in self.started for p in [proc.pid, *stacks.descendants(proc.pid)]]
        for proc in reversed(self.started):
            stacks.stop(proc, signal.SIGINT if proc is self.postgres_server else signal.SIGTERM)
        survivors = [pid for pid in tree if alive(pid)]
        if self.postgres is not None:  # any process of the cluster, even one that left the tree
            survivors += [pid for pid in processes_mentioning(str(self.postgres.folder)) if pid not in survivors]
            shutil.rmtree(self.postgres.folder, ignore_errors=True)
        return survivors

    def _track(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.started.append(proc)
        return proc


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stack_database(module) -> str:
    """The database of a module's stack: its STACK_DATABASE, else $TEST_STACK_DATABASE, else sqlite."""
    database = getattr(module, "STACK_DATABASE", None) or os.environ.get("TEST_STACK_DATABASE") or "sqlite"
    if database not in stacks.DATABASES:
        raise ValueError(f"TEST_STACK_DATABASE={database!r}: use one of {stacks.DATABASES}")
    if database == "postgres":
        require_postgres()
    return database


def require_postgres() -> None:
    """Skips the test, saying why, on a machine without PostgreSQL's binaries; fails instead where
    TEST_REQUIRE_POSTGRES is set (CI)."""
    try:
        postgres.bindir()
    except postgres.PostgresError as missing:
        if os.environ.get("TEST_REQUIRE_POSTGRES"):
            pytest.fail(f"TEST_REQUIRE_POSTGRES is set: {missing}")
        pytest.skip(f"no PostgreSQL on this machine: {missing}")


def _stack_up(tmp_path_factory, database: str):
    """A RunningStack on ``database``, up; stopped (and checked to leave no process) when the generator closes."""
    logs = tmp_path_factory.mktemp("stack-logs")
    running = RunningStack(home=tmp_path_factory.mktemp("prefect-home"), logs=logs,
                           allowed_root=tmp_path_factory.getbasetemp(), database=database)  # fmt: skip
    try:
        running.up()
        yield running
    finally:
        survivors = running.down()
        assert not survivors, f"processes left running by the stack: {survivors}"


@pytest.fixture(scope="session")
def shared_sqlite_stack(tmp_path_factory):
    """One SQLite stack per pytest process (per xdist worker), started by the first module that asks for it and
    shared by every module that does not need a stack of its own: each start costs a server, `prefect deploy` and a
    worker (tens of seconds on 2 loaded cores), five modules used to start one each (issue 47)."""
    yield from _stack_up(tmp_path_factory, "sqlite")


@pytest.fixture(scope="module")
def prefect_stack(request, tmp_path_factory):
    """Server + pool + deployments + heartbeat window + worker for a test module: this process's shared SQLite stack
    (``shared_sqlite_stack``), or one of the module's own where it sets ``STACK_DATABASE = "postgres"`` (or
    TEST_STACK_DATABASE does) or ``OWN_STACK = True`` (a module that stops the server or changes what every module
    relies on). The shared stack's worker runs while a module uses it: it is started here (or replaced, where a
    module killed it) and stopped when the module ends. A worker polls the server every second
    (PREFECT_WORKER_QUERY_SECONDS=1, for quick pick-ups): left up between modules, it and the server's answers took
    6.1 CPU s a minute of an idle stack against 1.6 without it, for the rest of the session, on each xdist process."""
    database = stack_database(request.module)
    if database != "sqlite" or getattr(request.module, "OWN_STACK", False):
        yield from _stack_up(tmp_path_factory, database)
        return
    running = request.getfixturevalue("shared_sqlite_stack")
    if running.worker is None or running.worker.poll() is not None:
        running.start_worker()
    yield running
    if running.worker is not None and running.worker.poll() is None:
        stacks.stop(running.worker)
