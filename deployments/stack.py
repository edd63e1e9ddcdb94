"""A local Prefect stack for the training deployments: server, work pool, deployments, reconciler, worker.

People use it through make (state in ./.prefect, the UI at http://127.0.0.1:4200):

    make stack                  # all of it, on SQLite; Ctrl-C stops the worker and the server
    make stack DB=postgres      # the same on a PostgreSQL server of its own (deployments/postgres.py)
    make server / make deploy / make worker      # the same pieces, one terminal each

The server's database: SQLite at $PREFECT_HOME/prefect.db (no set-up; the default), a PostgreSQL cluster that
the stack creates, starts and stops itself in ./.prefect/postgres (STACK_DATABASE=postgres, or --database),
or a PostgreSQL server of yours (PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://...). Only the
server's process is given the database URL; it is printed with its password hidden. The server and PostgreSQL get
none of the caller's credentials (the worker's flow runs need them; a server does not). A child that dies makes the
stack stop the rest and exit non-zero (128+N for signal N), so that a supervisor's restart-on-failure fires.

The worker is Prefect's process worker with another stop (deployments/worker.py): SIGTERM or Ctrl-C preempts its flow
runs (a checkpoint, then each reschedules itself) instead of killing them, and runs the reconciler
(deployments/recovery.py), the one component that restarts a crashed training run. ``up`` and ``worker`` also start
it on its own, ``python -m deployments.recovery``: two reconcilers at once still make one restart.

A worker started here gives its flow runs OMP_NUM_THREADS (one less than this machine's cores, unless set):
torch's default, one OpenMP thread per core, collapses when the server and worker share those cores.

The end-to-end tests start the same pieces with a temporary PREFECT_HOME and a free port. Every
process is started in its own session so that stopping it can take its whole process tree down.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from deployments import postgres, private_paths
from deployments.server_output import ServerOutput, relay
from training.lifetimes import die_with_parent_now

ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
POOL = "local-process"
DATABASES = ("sqlite", "postgres")
CONNECTION_URL = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
# Settings that reach the database: only the server's process gets them, never a worker or a flow run.
DATABASE_SETTINGS = ("PREFECT_SERVER_DATABASE_", "PREFECT_API_DATABASE_")
# All the server's process keeps of the caller's environment: Prefect's settings and what Python, the locale, TLS
# and proxies read. Never credentials (AWS_*, TRAIN_NODE_SECRET, PREFECT_API_KEY): a server uses none of them.
SERVER_KEEPS = (
    *("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV"),
    *("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY"),
)  # matched in upper case: http_proxy too
SERVER_KEEPS_PREFIXES = ("PREFECT_", "LC_", "PYTHON")


@dataclass
class Stack:
    """Where one stack keeps its state and answers; ``env()`` is the environment of every process in it."""

    home: Path
    port: int = 4200
    host: str = "127.0.0.1"  # where the server listens; another address lets other machines (or namespaces) in
    extra_env: dict[str, str] = field(default_factory=dict)
    database_url: str | None = None  # None: SQLite at $PREFECT_HOME/prefect.db. A secret: see postgres.redact

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    def env(self, **extra: str) -> dict[str, str]:
        return self._environment(os.environ, extra)

    def server_env(self) -> dict[str, str]:
        """The stack's settings, the part of the caller's environment a server reads (SERVER_KEEPS) and, for the
        server alone, its database."""
        kept = {k: v for k, v in os.environ.items() if k.upper() in SERVER_KEEPS or k.startswith(SERVER_KEEPS_PREFIXES)}
        kept.pop("PREFECT_API_KEY", None)
        return self._environment(kept, {CONNECTION_URL: self.database_url} if self.database_url else {})

    def client_env(self) -> dict[str, str]:
        """For a child that only talks to the server's API (the recovery sweeper): the server's share of the caller's
        environment, its API key included, and no database URL; never the storage credentials flow runs need."""
        kept = {k: v for k, v in os.environ.items() if k.upper() in SERVER_KEEPS or k.startswith(SERVER_KEEPS_PREFIXES)}
        return self._environment(kept, {})

    def _environment(self, caller: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in caller.items() if not k.startswith(DATABASE_SETTINGS)}
        env.update(
            PREFECT_HOME=str(self.home),
            PREFECT_API_URL=self.api_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            TRAINING_PROJECT_DIR=str(ROOT),
        )
        env.update(self.extra_env)
        env.update(extra)
        return env

    def describe_database(self) -> str:
        if not self.database_url:
            return f"SQLite at {self.home / 'prefect.db'}"
        return f"PostgreSQL {postgres.redact(self.database_url)}"

    def prefect(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """Runs ``prefect <args>`` against this stack; raises with its output if it fails."""
        proc = subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc


def start_server(stack: Stack, log: Path | None = None, terminal: bool = False) -> subprocess.Popen:
    """``prefect server start`` on <host>:<port> (127.0.0.1 unless the stack says), on the stack's database. Its
    home must be this user's and closed to others (private_paths.UntrustedPath): the server writes its state there.
    ``terminal`` (`make stack`, `make server`): its output whole in <home>/server.log, and at this terminal without
    SQLite's lock tracebacks (deployments/server_output.py)."""
    os.close(private_paths.open_folder(stack.home, create_mode=0o755))
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", stack.host, "--port", str(stack.port)]
    if not terminal:
        return _spawn(command, stack.server_env(), log)
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=stack.server_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent_now, os.getpid(), signal.SIGTERM),  # see _spawn
    )
    assert proc.stdout is not None  # stdout=PIPE
    relay(proc.stdout, ServerOutput(open(stack.home / "server.log", "a"), _say))  # noqa: SIM115 - the relay's
    return proc


def _say(text: str) -> None:
    print(text, end="", flush=True)


def wait_healthy(stack: Stack, server: subprocess.Popen, timeout: float = 180) -> None:
    """Polls /api/health until the server answers (or fails if the server process ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"prefect server exited with {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{stack.api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server at {stack.api_url} not healthy after {timeout}s")


def create_pool(stack: Stack, pool: str = POOL) -> None:
    """Creates the process work pool (an existing one is kept)."""
    found = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "inspect", pool],
        cwd=ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        stack.prefect("work-pool", "create", pool, "--type", "process")


def deploy(stack: Stack) -> list[str]:
    """``prefect deploy --all`` with deployments/prefect.yaml, from the project root; the names it deployed."""
    proc = stack.prefect(
        "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_YAML.relative_to(ROOT)), timeout=300
    )
    return deployed(proc.stdout)


def deployed(output: str) -> list[str]:
    """The deployments ``prefect deploy`` says it created or updated ("Deployment 'train/default' successfully ...")."""
    return re.findall(r"Deployment '([^'\s]+/[^'\s]+)'\s+successfully", output)


def install_automations(stack: Stack, *extra_args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.automations", *extra_args],
        cwd=ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"deployments.automations exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def start_worker(
    stack: Stack, log: Path | None = None, pool: str = POOL, stop_seconds: float | None = None, **env: str
) -> subprocess.Popen:
    """A process worker for the pool (deployments/worker.py: Prefect's, whose stop preempts its flow runs instead of
    killing them, waiting up to ``stop_seconds`` for them); flow runs start in TRAINING_PROJECT_DIR (the project),
    with ``worker_threads()`` OpenMP threads."""
    env = {"OMP_NUM_THREADS": str(worker_threads()), **env}
    waits = [] if stop_seconds is None else ["--stop-seconds", str(stop_seconds)]
    return _spawn([sys.executable, "-m", "deployments.worker", "--pool", pool, *waits], stack.env(**env), log)


def start_recovery(stack: Stack, log: Path | None = None) -> subprocess.Popen:
    """``python -m deployments.recovery``: the reconciler that restarts crashed training runs, once each."""
    return _spawn([sys.executable, "-m", "deployments.recovery"], stack.client_env(), log)


def worker_threads() -> int:
    """OMP_NUM_THREADS for the worker's flow runs: this environment's, else one less than the usable cores.

    torch starts one OpenMP thread per core; on a machine that also runs the server and the worker, its threads
    wait for each other at every operation (measured on 2 cores: 2 threads 283-32,000 samples/s, 1 thread
    31,000-54,000)."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, len(os.sched_getaffinity(0)) - 1)


def ui_answers(stack: Stack) -> bool:
    """Whether the server at the stack's port serves Prefect's UI (a temporary server, or PREFECT_UI_ENABLED=false,
    has none)."""
    try:
        with urllib.request.urlopen(stack.ui_url, timeout=5) as response:
            return response.status == 200 and "html" in response.headers.get("content-type", "")
    except OSError:
        return False


def where_the_ui_is(stack: Stack) -> str:
    if ui_answers(stack):
        return f"Prefect UI: {stack.ui_url}"
    return f"no Prefect UI answers at {stack.ui_url}: start the server with `make server` (or `make stack`)"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Stops a process started here and its whole tree: its session's group, then any descendant left."""
    stop_together([proc], sig, timeout)


def stop_together(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Stops processes started here and their trees at once: ``sig`` to each, one ``timeout`` for all of them, then
    SIGKILL to whatever ignored it. Stopped one after another, a worker and a reconciler that each took their time
    made the stack's Ctrl-C outlast what a terminal (or a test) waits for."""
    trees = [(proc, descendants(proc.pid)) for proc in procs]
    for proc, tree in trees:
        for target in (lambda p=proc.pid: os.killpg(p, sig), *[lambda p=p: os.kill(p, sig) for p in tree]):
            with contextlib.suppress(ProcessLookupError):
                target()
    deadline = time.monotonic() + timeout
    for proc, _ in trees:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc, tree in trees:
        for pid in [proc.pid, *tree]:  # whatever ignored the polite signal
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL) if pid == proc.pid else os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def _spawn(command: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen:
    """A child of the stack in a session of its own; the kernel sends it SIGTERM, its polite stop, when the process
    that started it dies, even by SIGKILL, so a stack killed while it stops leaves no server, worker or reconciler
    behind (PostgreSQL gets SIGINT the same way: deployments/postgres.py)."""
    out = open(log, "ab") if log else None  # noqa: SIM115 - handed to the child, closed with the test's tmp dir
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent_now, os.getpid(), signal.SIGTERM),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    stack = Stack(home=Path(os.path.abspath(args.home)), port=args.port, host=args.host)  # links: checked, not followed
    if args.command == "deploy":
        _deploy_all(stack)
        print(where_the_ui_is(stack))
        return 0
    procs: list[tuple[str, subprocess.Popen]] = []
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the stack as cleanly as Ctrl-C
    try:
        if args.command in ("up", "server"):
            stack.database_url = _database(args, procs)
            procs.append(("server", start_server(stack, terminal=True)))
            wait_healthy(stack, procs[-1][1])
            print(
                f"Prefect server: API {stack.api_url}, state in {stack.home}, database {stack.describe_database()}, "
                f"log {stack.home / 'server.log'}"
            )
        if args.command == "up":
            _deploy_all(stack)
        if args.command in ("up", "worker"):
            procs.append(("worker", start_worker(stack)))
            print(f"worker on pool {POOL}; its flow runs get OMP_NUM_THREADS={worker_threads()}")
            procs.append(("recovery", start_recovery(stack)))  # the reconciler, also when the worker is replaced
        print(f"Use it from another shell:  export PREFECT_HOME={stack.home} PREFECT_API_URL={stack.api_url}")
        print(where_the_ui_is(stack))
        print("Ctrl-C stops " + " and ".join(name for name, _ in procs))
        while all(p.poll() is None for _, p in procs):
            time.sleep(1)
        return _ended(procs)
    except KeyboardInterrupt:
        return 0
    except private_paths.UntrustedPath as untrusted:
        print(f"error: --home {stack.home}: {untrusted}: choose a folder that no one else can change", file=sys.stderr)
        return 2
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not leave an orphan behind
            signal.signal(sig, signal.SIG_IGN)
        # The worker and the reconciler together (the worker waits for its runs' preemption), then the server they
        # talk to, then its database (SIGINT: PostgreSQL's fast shutdown)
        stop_together([proc for name, proc in procs if name not in ("server", "postgres")])
        for name, proc in reversed(procs):
            if name in ("server", "postgres"):
                stop(proc, signal.SIGINT if name == "postgres" else signal.SIGTERM)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.stack",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "server", "deploy", "worker"])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PREFECT_PORT", "4200")))
    parser.add_argument(
        "--host",
        default=os.environ.get("STACK_HOST") or "127.0.0.1",
        help="the server's address, for every command (default: $STACK_HOST, else 127.0.0.1); workers on other "
        "machines need one they reach (docs/multinode.md)",
    )
    parser.add_argument("--home", type=Path, default=ROOT / ".prefect")
    parser.add_argument(
        "--database",
        choices=DATABASES,
        default=os.environ.get("STACK_DATABASE") or "sqlite",
        help=f"the server's database when {CONNECTION_URL} is not set (default: $STACK_DATABASE, else sqlite)",
    )
    parser.add_argument(
        "--postgres-dir",
        type=Path,
        default=Path(os.environ.get("STACK_POSTGRES_DIR") or ROOT / ".prefect" / "postgres"),
        help="with --database postgres: the cluster's folder (default: $STACK_POSTGRES_DIR, else .prefect/postgres)",
    )
    parser.add_argument(
        "--postgres-port",
        type=int,
        default=int(os.environ.get("STACK_POSTGRES_PORT") or 0),
        help="with --database postgres: its port on 127.0.0.1 (default: $STACK_POSTGRES_PORT, else a free one)",
    )
    return parser


def _database(args: argparse.Namespace, procs: list[tuple[str, subprocess.Popen]]) -> str | None:
    """The server's database URL: the configured one, a PostgreSQL server started here (added to ``procs``), or
    None for SQLite."""
    configured = os.environ.get(CONNECTION_URL)
    if configured:
        if args.database == "postgres":
            raise SystemExit(
                f"error: --database postgres starts a server of the stack's own, but {CONNECTION_URL} "
                f"names one ({postgres.redact(configured)}): unset one of them"
            )
        return configured
    if args.database == "sqlite":
        return None
    from flows.server import free_port

    folder = Path(os.path.abspath(args.postgres_dir))  # not resolved: a link on the way is checked, not followed
    server = postgres.LocalPostgres(folder, args.postgres_port or free_port())
    try:
        procs.append(("postgres", server.start(log=folder / "postgres.log")))
        server.wait_ready(procs[-1][1])
    except postgres.PostgresError as refused:
        raise SystemExit(f"error: {refused}") from None
    user = postgres.os_user()
    if server.home != folder and user is not None:
        print(f"PostgreSQL runs as {user.pw_name}, which cannot reach {folder}: its data in {server.home}")
    print(f"PostgreSQL on 127.0.0.1:{server.port}, cluster in {folder}, log {folder / 'postgres.log'}")
    return server.url


def _ended(procs: list[tuple[str, subprocess.Popen]]) -> int:
    """The stack's exit status once one of its children ended by itself: never 0, so that a supervisor's
    restart-on-failure fires; 128+N for a death by signal N, as shells report it."""
    name, code = next((name, p.returncode) for name, p in procs if p.returncode is not None)
    status = 128 - code if code < 0 else code or 1
    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
    print(f"error: {name} {how} while the stack ran: stopping the stack (exit {status})", file=sys.stderr)
    return status


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _deploy_all(stack: Stack) -> None:
    create_pool(stack)
    names = deploy(stack)
    print(install_automations(stack), end="")
    print(f"deployed: {', '.join(names)} on work pool {POOL} (schedules: deployments/prefect.yaml)")


if __name__ == "__main__":
    sys.exit(main())
