"""The rank processes of one attempt: started once with torchrun, kept across units, told what to do over a socket.

A unit on several processes used to be a fresh ``torchrun`` per unit: every unit paid interpreter start, torch
import, process-group set-up and a cold restore (~10 s here for under 2 s of training). A gang is started by the
attempt's first distributed unit (PyTorch's own launcher: ``torchrun --standalone``) and kept: each further unit
is a command to the ranks that are already up, with their sessions still in memory (training/unit/warm.py), and still
its own Prefect task with its own retry and checkpoint.

The parent (the unit task's process) listens on a loopback port; global rank 0 connects with a one-time token and
relays commands to the other ranks through the process group. Rank 0 answers with the unit's result, the reports
of a loop of its own (``on_report``), or an error. Any failure ends the gang: a rank that raises writes what it
raised to the gang's folder and exits, torchrun stops the others, and the parent raises that error — typed
(a ``ConfigError``, an ``UnsafeCheckpointError`` naming its file, ``Preempted``...), so that what must not be retried
is not — or ``DistributedUnitError`` (retried: the retry starts a fresh gang that resumes from the last checkpoint).
What ended the gang is decided here, once torchrun has exited, from its failure record and the ranks' records
(training/distributed/deaths.py): a rank that died is a ``RankDied``, and the other ranks' stop (torchrun's cleanup
SIGTERM) is part of it, not a preemption.
Nothing outlives the parent: torchrun dies with it (``PR_SET_PDEATHSIG``), and so does each rank with torchrun.

A stop request of the parent (a termination signal, a newer attempt taking over) is forwarded to rank 0; the ranks
agree on it at their next step boundary (training/preemption.py).

Across machines (``nnodes > 1``) this process is node 0: its torchrun hosts the rendezvous it chose, and the other
nodes are started (and stopped with the gang) by a ``NodeLauncher`` that the caller hands in — Prefect flow runs,
from tasks/nodes.py — each with an offer signed for it (training/distributed/nodes.py). A node that ends early ends the gang.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import select
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from checkpointing.io import confine
from training import preemption
from training.config import ConfigError, TrainConfig
from training.config.machines import node_secret
from training.distributed import nodes
from training.distributed.deaths import MAX_LINES, verdict
from training.distributed.launcher import NodeSeat, Torchrun, relay_output
from training.exceptions import DistributedUnitError
from training.lifetimes import kill_group, remove_stale_folders
from training.recipe.loader import resolve_recipe
from training.unit.loop import UnitResult

logger = logging.getLogger(__name__)

ADDRESS_ENV, TOKEN_ENV = "TRAIN_GANG_ADDRESS", "TRAIN_GANG_TOKEN"  # and FOLDER_ENV: training/distributed/launcher.py
START_TIMEOUT = 300.0  # seconds for torchrun's ranks to start and rank 0 to call back (imports on a loaded machine)
MAX_MESSAGE = 64 * 1024 * 1024  # a result or report line; anything longer is not rank 0's
NODE_CHECK_EVERY = 2.0  # seconds between looks at the other nodes' runs (nnodes > 1)
NODE_EXIT_GRACE = 30.0  # seconds for the other nodes to end by themselves after a clean exit, before they are stopped


class Op(StrEnum):
    """What the parent tells the ranks: a command's ``op`` (one JSON line; rank 0 passes it to the other ranks)."""

    UNIT = "unit"  # train one unit (training.unit.loop.run_unit)
    LOOP = "loop"  # run the recipe's own loop (training.unit.own_loop)
    STOP = "stop"  # a stop request: the ranks agree on it at their next step boundary (training/preemption.py)
    EXIT = "exit"  # leave: the gang is closing


class Gang:
    """torchrun's ranks for one attempt of one run (``key``), and the socket to its rank 0."""

    def __init__(
        self, config: TrainConfig, key: tuple, generation: int = 0, launcher: nodes.NodeLauncher | None = None
    ):
        self.key, self.config, self.generation, self.launcher = key, config, generation, launcher
        self._node_check = 0.0
        remove_stale_folders(FOLDER_PREFIX)  # a SIGKILLed unit process's (its ranks died with it, its folder stayed)
        self._folder = tempfile.TemporaryDirectory(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        self._token = secrets.token_hex(16)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._conn: socket.socket | None = None
        self._buffer = b""
        self._stop_sent = False
        self._killed = False  # torchrun was SIGKILLed by this process (its ranks' silence is then no evidence)
        self.proc = self._launch()
        self._lines: deque[str] = deque(maxlen=MAX_LINES)  # torchrun's last lines: its failure record
        self._relay = threading.Thread(
            target=relay_output, args=(self.proc, logger, self._lines), name="gang-output", daemon=True
        )
        self._relay.start()
        self._accept()

    # -- start ------------------------------------------------------------------------------------
    def _launch(self) -> subprocess.Popen:
        secret = node_secret() if self.config.nnodes > 1 else ""  # before anything is started
        env = dict(os.environ)
        if self.config.storage_options:
            env["TRAIN_STORAGE_OPTIONS"] = json.dumps(self.config.storage_options)
        env.update({ADDRESS_ENV: f"127.0.0.1:{self._listener.getsockname()[1]}", TOKEN_ENV: self._token})
        # This process already decided the recipe may run here; its ranks inherit that decision, nothing more.
        recipe = resolve_recipe(self.config.recipe)
        roots = confine.roots()  # a deployment run's ranks stay under the worker's roots (local and object-store)
        rendezvous = nodes.choose_rendezvous() if self.config.nnodes > 1 else None
        seat = None
        if rendezvous is not None:
            seat = NodeSeat(self.config.nnodes, 0, rendezvous.endpoint, rendezvous.rdzv_id, rendezvous.address)
        logger.info(
            "starting %d rank process(es) with torchrun%s (kept for the units of this attempt)",
            self.config.nproc_per_node,
            f" as node 0 of {self.config.nnodes} at {rendezvous.endpoint}" if rendezvous else "",
        )
        proc = Torchrun(self.config.nproc_per_node, recipe, roots, seat).start(
            self.config, Path(self._folder.name), env
        )
        if rendezvous is not None:
            self._start_nodes(proc, rendezvous, secret)
        return proc

    def _start_nodes(self, proc: subprocess.Popen, rendezvous: nodes.Rendezvous, secret: str) -> None:
        """The other nodes, each with its signed offer; a failure to start them stops node 0 too."""
        assert self.launcher is not None, "run_on_gang hands a launcher to every gang with nnodes > 1"
        config_json = json.loads(self.config.model_dump_json())
        try:
            self.launcher.start(
                nodes.make_offers(self.config, rendezvous, self.generation, config_json, secret), config_json
            )
        except BaseException:
            kill_group(proc.pid)
            proc.wait()
            self.launcher.stop()
            raise

    def _nodes_problem(self) -> str | None:
        """A line about a node run that ended, looked up at most every NODE_CHECK_EVERY seconds."""
        if self.launcher is None or time.monotonic() < self._node_check:
            return None
        self._node_check = time.monotonic() + NODE_CHECK_EVERY
        return self.launcher.problem()

    def _accept(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while self._conn is None:
            problem = self._nodes_problem()
            if self.proc.poll() is not None or time.monotonic() > deadline or problem:
                self.close()
                raise self._failure(f"the ranks did not start{f' ({problem})' if problem else ''}")
            ready, _, _ = select.select([self._listener], [], [], 0.2)
            if not ready:
                continue
            conn, _ = self._listener.accept()
            conn.settimeout(30)
            try:
                hello = json.loads(self._read_line(conn))
            except (OSError, ValueError):
                conn.close()
                continue
            if isinstance(hello, dict) and secrets.compare_digest(str(hello.get("token")), self._token):
                conn.settimeout(None)
                self._conn = conn
            else:
                conn.close()  # not our rank 0

    # -- commands -----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._conn is not None and self.proc.poll() is None

    def run(self, command: dict[str, Any], on_report: Callable[[UnitResult], None] | None = None) -> UnitResult:
        """Sends ``command`` to the ranks and waits for its result, passing reports to ``on_report``."""
        self._send(command)
        while True:
            message = self._next_message()
            if "report" in message:
                if on_report is not None:
                    on_report(UnitResult.model_validate(message["report"]))
            elif "result" in message:
                return UnitResult.model_validate(message["result"])
            elif "error" in message:  # rank 0's view (also in its record): what ended the gang is decided here
                raise self._failure("rank 0 reported an error")

    def _next_message(self) -> dict[str, Any]:
        assert self._conn is not None
        while b"\n" not in self._buffer:
            self._forward_stop()
            ready, _, _ = select.select([self._conn], [], [], 0.2)
            if not ready:
                if self.proc.poll() is not None:
                    break
                problem = self._nodes_problem()
                if problem:
                    self.close()
                    raise self._failure(f"the unit stopped: {problem}")
                continue
            chunk = self._conn.recv(1 << 20)
            if not chunk:
                break
            self._buffer += chunk
            if len(self._buffer) > MAX_MESSAGE:
                break
        if b"\n" not in self._buffer:
            self.close()
            raise self._failure("the ranks stopped before the unit was done")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _forward_stop(self) -> None:
        stop = preemption.STOP.current
        if stop is not None and not self._stop_sent:
            self._stop_sent = True
            self._send({"op": Op.STOP, "kind": stop.kind, "reason": stop.reason})

    def _send(self, message: dict[str, Any]) -> None:
        if self._conn is None:
            raise DistributedUnitError("the ranks are gone")
        try:
            self._conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            self.close()
            raise self._failure(f"the ranks stopped listening ({exc})") from exc

    @staticmethod
    def _read_line(conn: socket.socket) -> bytes:
        data = b""
        while not data.endswith(b"\n") and len(data) < 4096:
            chunk = conn.recv(4096 - len(data))
            if not chunk:
                break
            data += chunk
        return data

    # -- end ------------------------------------------------------------------------------------------
    def _failure(self, what: str) -> BaseException:
        """How the gang ended, decided here from evidence once torchrun is gone (training/distributed/deaths.py):
        a rank that died (``RankDied``), the error a rank recorded (typed), a preemption only if this process was
        asked to stop first, else DistributedUnitError."""
        stopped_here = preemption.STOP.current is not None  # before closing: what this process was asked first
        self.close()
        exited = not self._killed
        self._relay.join(timeout=10)  # torchrun's failure record is its last output
        error = verdict(
            Path(self._folder.name), list(self._lines), self.config.nproc_per_node, exited, stopped_here, what,
            self.proc.returncode,
        )  # fmt: skip
        if not isinstance(error, preemption.Preempted):
            logger.error("%s", str(error).splitlines()[0] if str(error) else type(error).__name__)
        return error

    def close(self) -> None:
        """Asks the ranks to leave, then makes sure nothing of the gang is left running."""
        conn, self._conn = self._conn, None  # taken once: a second thread closing the gang finds it gone
        if conn is not None:
            with contextlib.suppress(OSError):  # rank 0 may be gone: torchrun is then stopping the others
                conn.sendall(json.dumps({"op": Op.EXIT}).encode() + b"\n")
            with contextlib.suppress(subprocess.TimeoutExpired):  # and prints its failure record as it exits
                self.proc.wait(timeout=20)
            conn.close()
        self._killed = self._killed or self.proc.poll() is None
        kill_group(self.proc.pid)  # ranks torchrun could not stop, or any left after a failure
        self.proc.wait()
        self._listener.close()
        _GANGS.pop(self.key, None)
        if self.launcher is not None:
            launcher, self.launcher = self.launcher, None
            try:  # the other nodes' runs: ending by themselves after a clean exit, else cancelled now
                launcher.stop(grace=NODE_EXIT_GRACE if self.proc.returncode == 0 else 0.0)
            except (
                Exception
            ) as exc:  # the API unreachable: each node still stops itself (training/distributed/node_run.py)
                logger.warning("could not stop the other nodes' runs: %s: %s", type(exc).__name__, exc)


FOLDER_PREFIX = "resumable-train-gang-"


_GANGS: dict[tuple, Gang] = {}


def gang_key(config: TrainConfig, generation: int) -> tuple:
    return (
        config.save_folder,
        config.run_name,
        generation,
        config.nproc_per_node,
        config.nnodes,
        config.parallelism,
        config.device,
        config.fingerprint(),
    )


def run_on_gang(
    config: TrainConfig,
    command: dict[str, Any],
    generation: int,
    on_report: Callable[[UnitResult], None] | None = None,
    launch_nodes: Callable[[], nodes.NodeLauncher] | None = None,
) -> UnitResult:
    """Runs ``command`` on this attempt's gang, starting one (and closing any other) when there is none alive.
    With ``nnodes > 1``, ``launch_nodes`` makes the launcher of the new gang's other nodes."""
    key = gang_key(config, generation)
    gang = _GANGS.get(key)
    if gang is None or not gang.alive:
        close_gangs()
        if config.nnodes > 1 and launch_nodes is None:
            raise ConfigError(
                f"nnodes={config.nnodes}: the other nodes are started as Prefect flow runs by the train flow's unit "
                f"task; run it through flows.train (python -m flows.train, train(), or the train deployment)"
            )
        launcher = launch_nodes() if config.nnodes > 1 and launch_nodes is not None else None
        gang = _GANGS[key] = Gang(config, key, generation, launcher)
    payload = {**command, "config": json.loads(config.model_dump_json()), "generation": generation}
    return gang.run(payload, on_report)


def close_gangs() -> None:
    for gang in list(_GANGS.values()):
        gang.close()


atexit.register(close_gangs)
