"""The stack's own PostgreSQL server (deployments/postgres.py) through the entry point people use, `make server
DB=postgres` (python -m deployments.stack): it prints where the UI and the database are without the password,
keeps its state across restarts, and leaves nothing running, even when whatever started it is SIGKILLed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployments import postgres
from deployments import stack as stacks
from flows.server import free_port
from tests.conftest import ROOT
from tests.integration.conftest import processes_mentioning, require_postgres

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(300)]


@pytest.fixture
def cluster_dir() -> Iterator[Path]:
    """A folder the server's user can enter (pytest's own are closed to others when run by root)."""
    require_postgres()
    base = Path(tempfile.mkdtemp(prefix="stack-test-"))
    base.chmod(0o711)
    try:
        yield base / "postgres"
    finally:
        for pid in processes_mentioning(str(base)):  # only if a test failed: what it started
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base)


def _wait_gone(text: str, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_postgres_stops_when_the_process_that_started_it_is_killed(cluster_dir):
    starter = subprocess.Popen(
        [sys.executable, "-c", f"""
import time
from pathlib import Path
from deployments.postgres import LocalPostgres
pg = LocalPostgres(Path({str(cluster_dir)!r}), {free_port()}, durable=False)
pg.wait_ready(pg.start(log=Path({str(cluster_dir.parent / "postgres.log")!r})))
print("ready", flush=True)
time.sleep(600)
"""],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert starter.stdout.readline().strip() == "ready"
    assert processes_mentioning(str(cluster_dir))  # the postmaster, started with -D <cluster>/data

    starter.kill()  # SIGKILL: no handler, no finally
    starter.wait(timeout=30)

    assert _wait_gone(str(cluster_dir)) == []


def _serve(home: Path, port: int, cluster: Path) -> tuple[subprocess.Popen, list[str]]:
    server = subprocess.Popen(
        [sys.executable, "-m", "deployments.stack", "server", "--database", "postgres", "--port", str(port),
         "--home", str(home), "--postgres-dir", str(cluster)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    printed = [server.stdout.readline()]
    while printed[-1] and not printed[-1].startswith("Ctrl-C stops"):
        printed.append(server.stdout.readline())
    return server, printed


def _stop(server: subprocess.Popen) -> str:
    server.send_signal(signal.SIGTERM)  # what `kill` sends; Ctrl-C is handled the same way
    rest = server.stdout.read()
    assert server.wait(timeout=60) == 0
    return rest


def test_make_server_on_postgres_says_where_the_ui_is_keeps_its_state_and_leaves_nothing(cluster_dir, tmp_path):
    home, port = tmp_path / "home", free_port()
    server, printed = _serve(home, port, cluster_dir)
    try:
        text = "".join(printed)
        assert f"Prefect UI: http://127.0.0.1:{port}\n" in printed, text
        assert stacks.ui_answers(stacks.Stack(home=home, port=port))  # the printed link serves the UI
        assert "PostgreSQL on 127.0.0.1:" in text and f"cluster in {cluster_dir}" in text
        assert "database PostgreSQL postgresql+asyncpg://prefect:***@127.0.0.1:" in text
        stacks.create_pool(stacks.Stack(home=home, port=port))
    finally:
        text += _stop(server)
    assert postgres.LocalPostgres(cluster_dir, 0).password() not in text
    assert _wait_gone(str(cluster_dir), timeout=5) == [] and not (home / "prefect.db").exists()

    server, printed = _serve(home, port, cluster_dir)  # again, on the same cluster
    try:
        assert stacks.Stack(home=home, port=port).prefect("work-pool", "inspect", stacks.POOL).returncode == 0
    finally:
        _stop(server)
    assert _wait_gone(str(cluster_dir), timeout=5) == []


def test_a_new_cluster_gets_a_new_password_never_one_it_finds(cluster_dir):
    cluster_dir.mkdir(mode=0o700)
    (cluster_dir / "password").write_text("left-behind\n")  # by an earlier cluster, or an operator
    (cluster_dir / "password").chmod(0o600)
    pg = postgres.LocalPostgres(cluster_dir, 0)

    pg.init()
    first = pg.password()
    assert first != "left-behind"
    pg.init()  # a restart: the same cluster, the same password
    assert pg.password() == first
    assert pg.home is not None
    shutil.rmtree(pg.home / "data")  # the cluster is gone: the next one is new
    pg.init()
    assert pg.password() not in (first, "left-behind")
