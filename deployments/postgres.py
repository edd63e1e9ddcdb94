"""A PostgreSQL server of the stack's own, for Prefect's server: created, started and stopped by the stack.

Prefect's server keeps its state in SQLite unless told otherwise; SQLite serialises every write, and under the
automations' event load its lock retries showed up as repeated restarts (deployments/automations.py). Prefect's
guidance past a laptop is PostgreSQL, which the stack can run itself (``make stack DB=postgres``) or reach
(``PREFECT_SERVER_DATABASE_CONNECTION_URL``, see deployments/stack.py and docs/deployments-postgres.md).

The cluster lives in one folder (``.prefect/postgres`` for ``make stack``; a temp dir in the tests):
``data/`` (initdb's), ``password`` (generated once, mode 0600, never printed). The server runs in the
foreground as a child of the stack, on 127.0.0.1 only, with no Unix socket, and gets SIGINT (a fast shutdown)
when its parent dies, however it dies: nothing of it outlives the stack.

PostgreSQL refuses to run as root. Run by root (CI, containers), the cluster belongs to, and the server runs as,
an unprivileged user: ``STACK_POSTGRES_OS_USER``, else ``postgres`` (Debian's packages create it), else
``nobody``; the cluster's folder must be reachable by that user (a folder under /root is not: then the cluster
goes to a folder of /var/tmp named after the requested one, and the stack says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import hashlib
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

SUPERUSER = "prefect"  # the cluster's superuser; Prefect connects as it
DATABASE = "prefect"
BINARIES = ("initdb", "postgres")
# Where distributions put the binaries when they are not on PATH (Debian/Ubuntu, then RHEL/Fedora's PGDG).
BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin")
# A throwaway cluster (tests) need not survive a power cut: these make its writes ~free.
NOT_DURABLE = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")


class PostgresError(RuntimeError):
    """PostgreSQL cannot be set up or started here; the message says what to do."""


def bindir() -> Path:
    """The folder with ``initdb`` and ``postgres``: $STACK_POSTGRES_BIN, PATH, ``pg_config --bindir``, or the
    newest of the distributions' own folders (Debian's /usr/lib/postgresql/<major>/bin is not on PATH)."""
    configured = os.environ.get("STACK_POSTGRES_BIN")
    candidates = [Path(configured)] if configured else []
    if not configured:
        found = shutil.which("initdb")
        candidates += [Path(found).resolve().parent] if found else []
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10).stdout
            candidates += [Path(out.strip())] if out.strip() else []
        candidates += sorted((Path(p) for g in BIN_GLOBS for p in glob.glob(g)), key=_major, reverse=True)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in BINARIES):
            return folder
    where = f"STACK_POSTGRES_BIN={configured}" if configured else "PATH, pg_config or " + ", ".join(BIN_GLOBS)
    raise PostgresError(f"PostgreSQL's {' and '.join(BINARIES)} not found in {where}: install PostgreSQL "
                        f"(Debian: apt-get install postgresql) or set STACK_POSTGRES_BIN to its bin folder")  # fmt: skip


def _major(folder: Path) -> int:
    digits = "".join(c for c in folder.parent.name if c.isdigit())
    return int(digits) if digits else 0


def os_user() -> pwd.struct_passwd | None:
    """The unprivileged user the server runs as when this process is root; None when it is not root."""
    if os.geteuid() != 0:
        return None
    configured = os.environ.get("STACK_POSTGRES_OS_USER")
    for name in [configured] if configured else ["postgres", "nobody"]:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PostgresError(f"PostgreSQL refuses to run as root and there is no user {configured or 'postgres or nobody'}"
                        " to run it as: create one (useradd --system postgres) or set STACK_POSTGRES_OS_USER")  # fmt: skip


def reachable(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether ``user`` may enter every folder above ``path`` (judged from the mode bits, as the kernel would);
    folders not made yet count as open (``init`` makes them with the usual 0755)."""
    groups = {user.pw_gid, *(g.gr_gid for g in _groups_of(user.pw_name))}
    for folder in path.resolve().parents:
        if not folder.exists():
            continue
        st = folder.stat()
        bit = stat.S_IXUSR if st.st_uid == user.pw_uid else stat.S_IXGRP if st.st_gid in groups else stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def _groups_of(name: str) -> list:
    import grp

    return [g for g in grp.getgrall() if name in g.gr_mem]


def cluster_folder(requested: Path, user: pwd.struct_passwd | None) -> Path:
    """``requested``, or, when the server's user cannot reach it, a folder of /var/tmp named after it."""
    if user is None or reachable(requested, user):
        return requested
    tag = hashlib.sha256(str(requested.resolve()).encode()).hexdigest()[:12]
    return Path("/var/tmp") / f"resumable-train-postgres-{tag}"


@dataclass
class LocalPostgres:
    """A cluster in ``folder`` (created on first use) served on 127.0.0.1:``port``."""

    folder: Path
    port: int
    durable: bool = True  # False: no fsync (a throwaway cluster, e.g. the tests')

    @property
    def url(self) -> str:
        """The connection URL for Prefect's server, password included: a secret; show ``redact(url)``."""
        return f"postgresql+asyncpg://{SUPERUSER}:{self.password()}@127.0.0.1:{self.port}/{DATABASE}"

    def password(self) -> str:
        return (self.folder / "password").read_text().strip()

    def init(self) -> None:
        """Creates the folder, its password and the cluster, once; owned by the server's user when run by root."""
        user = os_user()
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if user is not None:
            os.chown(self.folder, user.pw_uid, user.pw_gid)
        if (self.folder / "data" / "PG_VERSION").exists():
            return
        password = self.folder / "password"
        if not password.exists():
            fd = os.open(password, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
            if user is not None:  # initdb, run as that user, reads it
                os.chown(password, user.pw_uid, user.pw_gid)
        shutil.rmtree(self.folder / "data", ignore_errors=True)  # an initdb that was interrupted
        proc = subprocess.run(
            [str(bindir() / "initdb"), "-D", str(self.folder / "data"), "-U", SUPERUSER, f"--pwfile={password}",
             "--auth=scram-sha-256", "--no-locale", "--encoding=UTF8", "--no-sync", "--no-instructions"],
            capture_output=True, text=True, timeout=300, **_as_user(user),
        )  # fmt: skip
        if proc.returncode != 0:
            raise PostgresError(f"initdb in {self.folder / 'data'} exited {proc.returncode}:\n{proc.stderr}")

    def start(self, log: Path | None = None) -> subprocess.Popen:
        """Starts ``postgres`` in the foreground (its own session); it gets SIGINT if this process dies."""
        self.init()
        command = [str(bindir() / "postgres"), "-D", str(self.folder / "data"), "-p", str(self.port),
                   "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]  # fmt: skip
        for setting in () if self.durable else NOT_DURABLE:
            command += ["-c", setting]
        out = open(log, "ab") if log else None  # noqa: SIM115 - handed to the child
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
            **_as_user(os_user()),
        )

    def wait_ready(self, server: subprocess.Popen, timeout: float = 60) -> None:
        """Waits until the server takes connections, then creates Prefect's database if it is not there yet."""
        for attempt in Retrying(
            stop=stop_after_delay(timeout),
            wait=wait_fixed(0.2),
            retry=retry_if_exception_type((OSError, asyncio.TimeoutError, _NotYet)),
            reraise=True,
        ):
            with attempt:
                if server.poll() is not None:
                    raise PostgresError(f"postgres exited with {server.returncode} before it took connections")
                asyncio.run(self._create_database())

    async def _create_database(self) -> None:
        import asyncpg

        try:
            conn = await asyncpg.connect(
                host="127.0.0.1", port=self.port, user=SUPERUSER, password=self.password(), database="postgres",
                timeout=5,
            )  # fmt: skip
        except asyncpg.CannotConnectNowError as starting:  # "the database system is starting up"
            raise _NotYet() from starting
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
                await conn.execute(f'CREATE DATABASE "{DATABASE}"')
        finally:
            await conn.close()


class _NotYet(Exception):
    pass


def _as_user(user: pwd.struct_passwd | None) -> dict:
    """Popen arguments that run the child as ``user`` (None: as this process), from /, with its HOME."""
    if user is None:
        return {}
    env = {**os.environ, "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "cwd": "/", "env": env}


def _stop_with_parent() -> None:
    """``preexec_fn`` (runs after the change of user, which would reset it): the kernel sends SIGINT, PostgreSQL's
    fast shutdown, when the parent dies, even by SIGKILL (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # 1: PR_SET_PDEATHSIG


def redact(url: str) -> str:
    """``url`` for printing: all between ``//`` and the last ``@`` but the user name becomes ***, so a password
    is hidden even when it holds an unescaped ``@``, ``/`` or ``?``; a query string is hidden too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"
    userinfo, at, rest = rest.rpartition("@")
    shown = f"{userinfo.split(':', 1)[0]}:***@" if at else ""
    location, question, _ = rest.partition("?")
    return f"{scheme}://{shown}{location}" + ("?***" if question else "")


def temporary_folder() -> Path:
    """A fresh folder for a throwaway cluster, reachable by the server's user (the tests' pytest folders are not)."""
    return Path(tempfile.mkdtemp(prefix="stack-postgres-"))
