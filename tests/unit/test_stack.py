"""The local stack's settings (deployments/stack.py, deployments/postgres.py) without starting anything: which
database the server gets and who else sees it, how many threads a worker's flow runs get, where PostgreSQL's
binaries are found and where a cluster can live when the server must run as another user."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest

from deployments import postgres
from deployments import stack as stacks

SECRET_URL = "postgresql+asyncpg://prefect:s3cret-pw@db.example:5432/prefect"


def test_only_the_server_is_given_the_database_url_and_it_is_shown_without_its_password(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", "postgresql+asyncpg://u:other@elsewhere/db")
    monkeypatch.setenv("PREFECT_API_DATABASE_PASSWORD", "other")
    stack = stacks.Stack(home=tmp_path, database_url=SECRET_URL)

    assert stack.server_env()["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == SECRET_URL
    assert "PREFECT_API_DATABASE_PASSWORD" not in stack.server_env()  # the stack's choice, not a stray setting
    assert not [k for k in stack.env() if "DATABASE" in k]  # workers, CLI and flow runs get none of it
    assert stack.describe_database() == "PostgreSQL postgresql+asyncpg://prefect:***@db.example:5432/prefect"
    assert stacks.Stack(home=tmp_path).describe_database() == f"SQLite at {tmp_path / 'prefect.db'}"
    for awkward in ("p@ss/w?rd", "pw?sslmode=x", "a:b"):  # unescaped, as people do paste them
        shown = postgres.redact(f"postgresql+asyncpg://prefect:{awkward}@db:5432/prefect?sslmode=require")
        assert shown == "postgresql+asyncpg://prefect:***@db:5432/prefect?***"
    assert postgres.redact("postgresql+asyncpg://db/prefect") == "postgresql+asyncpg://db/prefect"


def test_a_worker_gives_its_flow_runs_one_thread_less_than_the_cores_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert stacks.worker_threads() == max(1, cores - 1)

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert stacks.worker_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: the default
    assert stacks.worker_threads() == max(1, cores - 1)


def _fake_bindir(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in postgres.BINARIES:
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)
    return folder


def test_postgres_binaries_off_path_are_found_in_the_newest_distribution_folder(tmp_path, monkeypatch):
    for major in ("9", "15", "13"):
        _fake_bindir(tmp_path / "lib" / "postgresql" / major / "bin")
    monkeypatch.setattr(postgres, "BIN_GLOBS", (str(tmp_path / "lib" / "postgresql" / "*" / "bin"),))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no initdb, no pg_config (Debian's layout)
    monkeypatch.delenv("STACK_POSTGRES_BIN", raising=False)

    assert postgres.bindir() == tmp_path / "lib" / "postgresql" / "15" / "bin"

    monkeypatch.setenv("STACK_POSTGRES_BIN", str(tmp_path / "nowhere"))
    with pytest.raises(postgres.PostgresError, match=r"not found in STACK_POSTGRES_BIN=.*nowhere"):
        postgres.bindir()


def test_a_cluster_the_server_user_cannot_reach_moves_to_var_tmp():
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp())  # /tmp/xyz, opened below: pytest's own folders are closed to others
    try:
        base.chmod(0o755)
        (base / "private").mkdir(mode=0o700)
        (base / "open").mkdir(mode=0o755)

        assert postgres.cluster_folder(base / "open" / "pg", nobody) == base / "open" / "pg"
        assert postgres.cluster_folder(base / "new" / "x" / "pg", nobody) == base / "new" / "x" / "pg"  # made later
        moved = postgres.cluster_folder(base / "private" / "pg", nobody)
        assert moved.parent == Path("/var/tmp") and moved.name.startswith("resumable-train-postgres-")
        assert postgres.cluster_folder(base / "private" / "pg", None) == base / "private" / "pg"  # not root
    finally:
        shutil.rmtree(base)
