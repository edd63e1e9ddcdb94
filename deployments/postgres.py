"""A PostgreSQL server of the stack's own, for Prefect's server: created, started and stopped by the stack.

Prefect's server keeps its state in SQLite unless told otherwise; SQLite serialises every write, and under the
automations' event load its lock retries showed up as repeated restarts (before the reconciler replaced them:
deployments/automations.py). Prefect's
guidance past a laptop is PostgreSQL, which the stack can run itself (``make stack DB=postgres``) or reach
(``PREFECT_SERVER_DATABASE_CONNECTION_URL``, see deployments/stack.py and docs/deployments-postgres.md).

The cluster lives in one folder (``.prefect/postgres`` for ``make stack``; a temp dir in the tests):
``data/`` (initdb's), ``password`` (new with every new cluster, mode 0600, never printed). The server runs in the
foreground as a child of the stack, on 127.0.0.1 only, with no Unix socket, with none of the stack's environment
but PATH, and gets SIGINT (a fast shutdown) when its parent dies, however it dies: nothing of it outlives the stack.

PostgreSQL refuses to run as root. Run by root (CI, containers), the cluster's data belongs to, and the server runs
as, an unprivileged user: ``STACK_POSTGRES_OS_USER``, else ``postgres`` (Debian's packages create it), else
``nobody``. The folder, its password and the log stay root's, and the stack trusts nothing it did not make: every
folder on the way must be root's (or the stack's user's) and closed to others, and nothing is reached through a
link someone else made (deployments/private_paths.py). When the server's user cannot reach the folder (one under
/root), its ``data/`` goes to a fresh private folder of /var/lib/resumable-train, recorded in the folder
(``data-home``) so that the next start finds the same data.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
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

from deployments import private_paths

SUPERUSER = "prefect"  # the cluster's superuser; Prefect connects as it
DATABASE = "prefect"
BINARIES = ("initdb", "postgres")
# Where distributions put the binaries when they are not on PATH (Debian/Ubuntu, then RHEL/Fedora's PGDG).
BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin")
# A throwaway cluster (tests) need not survive a power cut: these make its writes ~free.
NOT_DURABLE = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")
# Where the data goes when the server's user cannot reach the cluster's folder: root's, closed to others.
FALLBACK_BASE = Path("/var/lib/resumable-train")
HOME_RECORD = "data-home"  # in the cluster's folder: the fallback folder that holds its data/


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
    raise PostgresError(
        f"PostgreSQL's {' and '.join(BINARIES)} not found in {where}: install PostgreSQL "
        f"(Debian: apt-get install postgresql) or set STACK_POSTGRES_BIN to its bin folder"
    )


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
    raise PostgresError(
        f"PostgreSQL refuses to run as root and there is no user {configured or 'postgres or nobody'}"
        " to run it as: create one (useradd --system postgres) or set STACK_POSTGRES_OS_USER"
    )


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


def data_home(folder: Path, folder_fd: int, user: pwd.struct_passwd | None) -> Path:
    """Where the cluster's ``data/`` lives: in ``folder``, or, when the server's user cannot reach it, in a fresh
    private folder of FALLBACK_BASE, made once and recorded in ``folder`` (root's) so that restarts keep the data."""
    if user is None or reachable(folder / "data", user):
        return folder
    recorded = (private_paths.read_file(folder_fd, HOME_RECORD) or "").strip()
    if recorded:
        home = Path(recorded)
        if home.parent != FALLBACK_BASE:
            record = folder / HOME_RECORD
            raise PostgresError(
                f"{record} names {home}, not a folder of {FALLBACK_BASE}: remove {record} to start over"
            )
        with contextlib.suppress(FileNotFoundError):  # gone: a new cluster
            os.close(private_paths.open_folder(home))
            return home
    base_fd = private_paths.open_folder(FALLBACK_BASE, create_mode=0o711)
    os.fchmod(base_fd, 0o711)  # the server's user passes through, lists nothing
    os.close(base_fd)
    home = Path(tempfile.mkdtemp(prefix="postgres-", dir=FALLBACK_BASE))  # a name no one can guess, made here
    os.chmod(home, 0o711)  # by name: FALLBACK_BASE is root's alone, no one else can swap what is in it
    if not reachable(home / "data", user):
        raise PostgresError(f"{user.pw_name} cannot reach {home} either: set STACK_POSTGRES_DIR to a folder it can")
    private_paths.write_file(folder_fd, HOME_RECORD, f"{home}\n")
    return home


@dataclass
class LocalPostgres:
    """A cluster in ``folder`` (created on first use) served on 127.0.0.1:``port``."""

    folder: Path
    port: int
    durable: bool = True  # False: no fsync (a throwaway cluster, e.g. the tests')
    home: Path | None = None  # the folder holding data/: ``folder`` or its fallback (``init`` says)

    @property
    def url(self) -> str:
        """The connection URL for Prefect's server, password included: a secret; show ``redact(url)``."""
        return f"postgresql+asyncpg://{SUPERUSER}:{self.password()}@127.0.0.1:{self.port}/{DATABASE}"

    def password(self) -> str:
        fd = self._open_folder(create=False)
        try:
            password = private_paths.read_file(fd, "password")
        finally:
            os.close(fd)
        if password is None:
            raise PostgresError(f"no password in {self.folder}: the cluster is not made yet (LocalPostgres.init)")
        return password.strip()

    def init(self) -> None:
        """Makes the cluster once, with a new password; its data/ belongs to the server's user when run by root.
        Refuses a folder that someone else made or can change."""
        user = os_user()
        fd = self._open_folder(create=True)
        try:
            os.fchmod(fd, 0o711 if user else 0o700)  # the server's user passes through to data/, lists nothing
            self.home = data_home(self.folder, fd, user)
            if not (self.home / "data" / "PG_VERSION").exists():
                self._initdb(fd, user)
        except private_paths.UntrustedPath as untrusted:
            raise self._refusal(untrusted) from None
        finally:
            os.close(fd)

    def _open_folder(self, create: bool) -> int:
        try:
            return private_paths.open_folder(self.folder, create_mode=0o700 if create else None)
        except private_paths.UntrustedPath as untrusted:
            raise self._refusal(untrusted) from None

    def _refusal(self, untrusted: Exception) -> PostgresError:
        me = pwd.getpwuid(os.geteuid()).pw_name
        who = me if me == "root" else f"{me} or root"
        why = f"the stack, run as {me}, uses only folders that {who} made and no one else can change"
        return PostgresError(f"STACK_POSTGRES_DIR={self.folder}: {untrusted}; {why}: choose another")

    def _initdb(self, folder_fd: int, user: pwd.struct_passwd | None) -> None:
        """A new cluster in ``home``/data, made by the server's user, with a new password."""
        assert self.home is not None
        home_fd = private_paths.open_folder(self.home)
        pwfile = f".initdb-{secrets.token_hex(8)}"
        try:
            with contextlib.suppress(FileNotFoundError):  # an initdb that was interrupted
                shutil.rmtree("data", dir_fd=home_fd)
            os.mkdir("data", 0o700, dir_fd=home_fd)
            if user is not None:
                data_fd = os.open("data", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=home_fd)
                os.fchown(data_fd, user.pw_uid, user.pw_gid)
                os.close(data_fd)
            password = secrets.token_urlsafe(24)
            private_paths.write_file(folder_fd, "password", password)
            private_paths.write_file(home_fd, pwfile, password, owner=user)  # initdb, run as that user, reads it
            self._run_initdb(self.home / pwfile, user)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pwfile, dir_fd=home_fd)
            os.close(home_fd)

    def _run_initdb(self, pwfile: Path, user: pwd.struct_passwd | None) -> None:
        assert self.home is not None
        proc = subprocess.run(
            [
                str(bindir() / "initdb"),
                "-D",
                str(self.home / "data"),
                "-U",
                SUPERUSER,
                f"--pwfile={pwfile}",
                "--auth=scram-sha-256",
                "--no-locale",
                "--encoding=UTF8",
                "--no-sync",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            **_as_user(user),
        )
        if proc.returncode != 0:
            raise PostgresError(f"initdb in {self.home / 'data'} exited {proc.returncode}:\n{proc.stderr}")

    def start(self, log: Path | None = None) -> subprocess.Popen:
        """Starts ``postgres`` in the foreground (its own session); it gets SIGINT if this process dies. ``log``
        is appended to as a file of this user's, never through a link."""
        self.init()
        assert self.home is not None
        command = [
            str(bindir() / "postgres"),
            "-D",
            str(self.home / "data"),
            "-p",
            str(self.port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "unix_socket_directories=",
        ]
        for setting in () if self.durable else NOT_DURABLE:
            command += ["-c", setting]
        try:
            out = private_paths.open_append(log) if log else None
        except private_paths.UntrustedPath as untrusted:
            raise PostgresError(f"the log {log}: {untrusted}: choose another") from None
        try:
            return subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=_stop_with_parent,
                **_as_user(os_user()),
            )
        finally:
            if out is not None:
                os.close(out)

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
                host="127.0.0.1",
                port=self.port,
                user=SUPERUSER,
                password=self.password(),
                database="postgres",
                timeout=5,
            )
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
    """Popen arguments that run the child as ``user`` (None: as this process; else from /) with a minimal
    environment: PostgreSQL needs none of the caller's, and its user can read it in /proc/<pid>/environ."""
    me = user or pwd.getpwuid(os.geteuid())
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": me.pw_dir, "USER": me.pw_name, "LOGNAME": me.pw_name}
    if user is None:
        return {"env": env}
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
