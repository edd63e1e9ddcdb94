"""The local stack's settings (deployments/stack.py, deployments/postgres.py) without starting anything: which
database the server gets and who else sees it, how many threads a worker's flow runs get, where PostgreSQL's
binaries are found and where a cluster can live when the server must run as another user."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from deployments import postgres, private_paths
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


def test_the_recovery_sweeper_gets_the_api_but_none_of_the_storage_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-key")
    monkeypatch.setenv("TRAIN_NODE_SECRET", "pool-secret")
    monkeypatch.setenv("PREFECT_API_KEY", "api-key")
    stack = stacks.Stack(home=tmp_path, port=4321, database_url="postgresql+asyncpg://prefect:pw@127.0.0.1:1/prefect")
    sweeper = stack.client_env()
    assert sweeper["PREFECT_API_URL"] == "http://127.0.0.1:4321/api" and sweeper["PREFECT_API_KEY"] == "api-key"
    assert "AWS_SECRET_ACCESS_KEY" not in sweeper and "TRAIN_NODE_SECRET" not in sweeper
    assert not any("pw@" in value for value in sweeper.values())  # nor the database's password
    assert stack.env()["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-key"  # the worker's flow runs still get them


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


def _data_home(requested: Path, user: pwd.struct_passwd | None) -> Path:
    """Where LocalPostgres.init keeps the data of a cluster in ``requested``, without making the cluster."""
    fd = private_paths.open_folder(requested, create_mode=0o700)
    try:
        os.fchmod(fd, 0o711)  # as init does when the server runs as another user
        return postgres.data_home(requested, fd, user)
    finally:
        os.close(fd)


def test_a_cluster_the_server_user_cannot_reach_keeps_its_data_in_one_fresh_private_folder(monkeypatch):
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp())  # /tmp/xyz, opened below: pytest's own folders are closed to others
    try:
        base.chmod(0o755)
        monkeypatch.setattr(postgres, "FALLBACK_BASE", base / "fallback")
        (base / "private").mkdir(mode=0o700)
        (base / "open").mkdir(mode=0o755)

        assert _data_home(base / "open" / "pg", nobody) == base / "open" / "pg"
        assert _data_home(base / "new" / "x" / "pg", nobody) == base / "new" / "x" / "pg"  # made now, 0755 above
        first = _data_home(base / "private" / "pg", nobody)
        st = os.lstat(first)
        assert first.parent == base / "fallback" and (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o711)
        assert _data_home(base / "private" / "pg", nobody) == first  # a restart finds the same data
        assert _data_home(base / "private" / "other", nobody) not in (first, base / "private" / "other")
        record = os.lstat(base / "private" / "pg" / postgres.HOME_RECORD)
        assert (record.st_uid, stat.S_IMODE(record.st_mode)) == (os.geteuid(), 0o600)

        (base / "private" / "pg" / postgres.HOME_RECORD).unlink()  # a folder it did not record is never adopted
        assert _data_home(base / "private" / "pg", nobody) not in (first, base / "private" / "pg")
        assert _data_home(base / "private" / "pg", None) == base / "private" / "pg"  # not root: no other user
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user: run as root")
def test_private_paths_refuse_what_someone_else_made_or_can_change(tmp_path):
    nobody = pwd.getpwnam("nobody")
    (tmp_path / "target").mkdir()
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", nobody.pw_uid, nobody.pw_gid)
    (tmp_path / "shared").mkdir(mode=0o777)
    (tmp_path / "shared").chmod(0o777)
    (tmp_path / "their-link").symlink_to(tmp_path / "target")
    os.lchown(tmp_path / "their-link", nobody.pw_uid, nobody.pw_gid)
    (tmp_path / "my-link").symlink_to(tmp_path / "target")  # root's own links are followed (/home -> /data/home)

    refused = {
        "their-link": "is a link made by nobody",
        "theirs": "belongs to nobody",
        "shared": "may be changed by others",
    }
    for folder, why in refused.items():
        with pytest.raises(private_paths.UntrustedPath, match=re.escape(f"{tmp_path / folder} {why}")):
            private_paths.open_folder(tmp_path / folder)
    os.close(private_paths.open_folder(tmp_path / "my-link" / "made", create_mode=0o700))
    assert (tmp_path / "target" / "made").is_dir()

    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    (tmp_path / "target" / "password").symlink_to(victim)
    os.link(victim, tmp_path / "target" / "log")
    fd = private_paths.open_folder(tmp_path / "target")
    try:
        with pytest.raises(private_paths.UntrustedPath, match="password is not a file"):
            private_paths.read_file(fd, "password")
        with pytest.raises(private_paths.UntrustedPath, match="has another name"):
            os.close(private_paths.open_append(tmp_path / "target" / "log"))
        private_paths.write_file(fd, "password", "new")  # replaces the link, never writes through it
        assert (tmp_path / "target" / "password").read_text() == "new" and victim.read_text() == "root's\n"
    finally:
        os.close(fd)
