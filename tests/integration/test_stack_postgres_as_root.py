"""The stack's own PostgreSQL run by root, next to a local user who planted links, folders and files first (issue
31): `python -m deployments.stack server --database postgres` as root, the attacker a real unprivileged user
(`runuser -u nobody`). Root follows, adopts and trusts nothing it did not make, gives PostgreSQL none of its
environment's secrets, and exits non-zero when its PostgreSQL dies."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from deployments import postgres
from deployments import stack as stacks
from flows.server import free_port
from tests.conftest import ROOT
from tests.integration.conftest import processes_mentioning, require_postgres
from tests.procs import cmdline, environ

pytestmark = [
    pytest.mark.slow,
    pytest.mark.system,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="the stack's root-only paths: run as root"),
]

SECRETS = {"AWS_SECRET_ACCESS_KEY": "planted-aws-secret-31", "TRAIN_NODE_SECRET": "planted-node-secret-31"}
PLANTED_PASSWORD = "the-attackers-own-password"
ROOTS_LINES = b"root's own log line\n"


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder of root's that others may enter (pytest's own are closed), with a file and a folder of root's that
    the attacker would like root to write to or hand over."""
    require_postgres()
    base = Path(tempfile.mkdtemp(prefix="stack-root-test-"))
    base.chmod(0o755)
    (base / "victim.log").write_bytes(ROOTS_LINES)
    (base / "victim-dir").mkdir(mode=0o700)
    try:
        yield base
    finally:
        for pid in processes_mentioning(str(base)):  # only if a test failed: what it started
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def _as_nobody(script: str) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", script], check=True)


def _old_fallback(requested: Path) -> Path:
    """Where the stack used to put a cluster its server's user could not reach: a name anyone could compute."""
    return Path("/var/tmp") / f"resumable-train-postgres-{hashlib.sha256(str(requested).encode()).hexdigest()[:12]}"


def _unreachable_cluster(base: Path) -> Path:
    (base / "closed").mkdir(mode=0o700)  # like /root: the server's user cannot enter
    return base / "closed" / "pg"


def _start(cluster: Path, until: str) -> tuple[subprocess.Popen, str]:
    stack = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deployments.stack",
            "server",
            "--database",
            "postgres",
            "--port",
            str(free_port()),
            "--home",
            str(cluster.parent / "home"),
            "--postgres-dir",
            str(cluster),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **SECRETS, "PYTHONUNBUFFERED": "1"},
    )
    assert stack.stdout is not None
    printed = [stack.stdout.readline()]
    while printed[-1] and not printed[-1].startswith(until):
        printed.append(stack.stdout.readline())
    return stack, "".join(printed)


def _home(cluster: Path) -> Path:
    """The fallback folder that holds the cluster's data, as the stack recorded it."""
    return Path((cluster / postgres.HOME_RECORD).read_text().strip())


def _remove(cluster: Path) -> None:
    """Removes the fallback folder the stack made for ``cluster`` (it is outside the test's folder)."""
    if (cluster / postgres.HOME_RECORD).exists() and _home(cluster).parent == postgres.FALLBACK_BASE:
        shutil.rmtree(_home(cluster), ignore_errors=True)


async def _connect(port: int, password: str) -> None:
    conn = await asyncpg.connect(
        host="127.0.0.1", port=port, user=postgres.SUPERUSER, password=password, database=postgres.DATABASE, timeout=10
    )
    await conn.close()


def test_root_hands_over_no_folder_shares_no_secret_and_fails_when_postgres_is_killed(base):
    cluster = _unreachable_cluster(base)
    planted = _old_fallback(cluster)
    _as_nobody(f"ln -s {base / 'victim-dir'} {planted}")
    stack, printed = _start(cluster, until="Ctrl-C stops")
    try:
        assert (os.stat(base / "victim-dir").st_uid, os.listdir(base / "victim-dir")) == (0, [])  # not handed over
        assert os.readlink(planted) == str(base / "victim-dir")
        home = _home(cluster)
        assert "PostgreSQL runs as postgres, which cannot reach" in printed and f"its data in {home}" in printed
        assert home.parent == postgres.FALLBACK_BASE and home != planted

        postmaster = processes_mentioning(str(home / "data"))
        server = [p for p in stacks.descendants(stack.pid) if b"server\0start" in cmdline(p)]
        assert postmaster and server
        assert SECRETS["TRAIN_NODE_SECRET"].encode() in environ(stack.pid)  # the stack had them ...
        for pid in postmaster + server:  # ... and gave them to neither PostgreSQL nor Prefect's server
            assert not [v for v in SECRETS.values() if v.encode() in environ(pid)], f"pid {pid} got a secret"

        os.kill(postmaster[0], signal.SIGKILL)
        rest = stack.communicate(timeout=60)[0]  # read as it goes: the server logs the lost database at length
        assert stack.returncode == 128 + signal.SIGKILL  # a supervisor's restart-on-failure fires
        assert "error: postgres was killed by signal 9" in rest
    finally:
        stacks.stop(stack)  # the tree, when the test failed before the stack ended
        os.unlink(planted)
        _remove(cluster)
    assert processes_mentioning(str(home)) == []


def test_root_ignores_a_planted_folder_its_password_and_its_log_link(base):
    cluster = _unreachable_cluster(base)
    planted = _old_fallback(cluster)
    _as_nobody(
        f"mkdir -m 0777 {planted} && echo {PLANTED_PASSWORD} > {planted}/password && "
        f"ln -s {base / 'victim.log'} {planted}/postgres.log"
    )
    stack, printed = _start(cluster, until="PostgreSQL on 127.0.0.1:")
    try:
        port = int(printed.rsplit("PostgreSQL on 127.0.0.1:", 1)[1].split(",")[0])
        with pytest.raises(asyncpg.InvalidPasswordError):
            asyncio.run(_connect(port, PLANTED_PASSWORD))
        asyncio.run(_connect(port, postgres.LocalPostgres(cluster, port).password()))  # a fresh one, root's
        assert (base / "victim.log").read_bytes() == ROOTS_LINES  # root appended nothing through the link
        assert (planted / "password").read_text() == f"{PLANTED_PASSWORD}\n"
        assert pwd.getpwuid(os.stat(planted).st_uid).pw_name == "nobody"  # not adopted
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.communicate(timeout=60)
        shutil.rmtree(planted)
        _remove(cluster)


def _state(folder: Path) -> dict:
    """Who owns what in ``folder`` (not followed), and what each thing holds."""
    found = {}
    for path in [folder, *folder.iterdir()]:
        st = os.lstat(path)
        found[path] = (st.st_uid, st.st_gid, st.st_mode, st.st_size, st.st_mtime_ns)
    return found


def test_a_cluster_folder_a_local_user_made_is_refused_in_one_line_and_left_as_it_was(base):
    shared = base / "shared"  # like /tmp: anyone may make folders in it
    shared.mkdir()
    shared.chmod(0o1777)
    _as_nobody(
        f"mkdir {shared}/pg && echo {PLANTED_PASSWORD} > {shared}/pg/password && "
        f"ln -s {base / 'victim.log'} {shared}/pg/postgres.log && ln -s {base / 'victim-dir'} {shared}/linked"
    )
    for cluster in (shared / "pg", shared / "linked"):
        before = _state(cluster)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "deployments.stack",
                "server",
                "--database",
                "postgres",
                "--home",
                str(base / "home"),
                "--postgres-dir",
                str(cluster),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0 and proc.stdout == ""
        assert proc.stderr.startswith(f"error: STACK_POSTGRES_DIR={cluster}: ") and proc.stderr.count("\n") == 1
        assert "choose another" in proc.stderr
        assert _state(cluster) == before  # nothing made, changed or chowned
    assert (base / "victim.log").read_bytes() == ROOTS_LINES and os.stat(base / "victim-dir").st_uid == 0
    assert processes_mentioning(str(shared)) == []


def test_a_prefect_home_a_local_user_made_is_refused_in_one_line(base):
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    _as_nobody(f"mkdir -m 0777 {shared}/home && ln -s {base / 'victim-dir'} {shared}/home/prefect.db")
    before = _state(shared / "home")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deployments.stack",
            "server",
            "--port",
            str(free_port()),
            "--home",
            str(shared / "home"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: --home {shared / 'home'}: {shared / 'home'} belongs to nobody")
    assert _state(shared / "home") == before and os.listdir(base / "victim-dir") == []
