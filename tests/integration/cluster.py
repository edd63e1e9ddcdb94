"""A Prefect work pool spread over several hosts (tests/integration/hosts.py), for the multi-machine tests.

The server listens on the bridge's address in the root namespace, so every host reaches it; the project's
deployments (train/default, rank-node/default) are deployed on the process pool; and each host runs one worker of
that pool with what a real machine's worker would have in its environment: its own ``TRAIN_NODE_ADDRESS``, the
pool's ``TRAIN_NODE_SECRET``, ``TRAIN_ALLOWED_ROOTS`` and the tests' recipes. Each worker runs one flow run at a
time (``--limit 1``), as a machine of a Kubernetes pool runs one node's pod: a train flow run and its node runs
land on different hosts.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from deployments import stack as stacks
from flows.server import free_port
from tests.conftest import ROOT, TEST_RECIPES
from tests.integration.hosts import Hosts

SECRET = secrets.token_hex(32)  # the pool's shared secret, for this test session only


class Cluster:
    """Hosts, the server on their bridge, and one worker per host."""

    def __init__(self, hosts: Hosts, home: Path, logs: Path, allowed_root: Path):
        self.hosts, self.logs, self.allowed_root = hosts, logs, allowed_root
        self.stack = stacks.Stack(
            home=home,
            port=free_port(),
            host=hosts.bridge_address,
            extra_env={
                "PYTHONPATH": str(ROOT),
                "TRAIN_ALLOWED_RECIPES": TEST_RECIPES,
                "TRAIN_ALLOWED_ROOTS": str(allowed_root),
                "PREFECT_LOGGING_LEVEL": "INFO",
                "PREFECT_WORKER_QUERY_SECONDS": "1",
                "OMP_NUM_THREADS": "1",
            },
        )
        self.server: subprocess.Popen | None = None
        self.workers: dict[int, subprocess.Popen] = {}

    @property
    def api_url(self) -> str:
        return self.stack.api_url

    def env(self, **extra: str) -> dict[str, str]:
        return self.stack.env(**extra)

    def node_env(self, i: int) -> dict[str, str]:
        """What host i's worker (and so its flow runs) has in its environment."""
        return self.env(TRAIN_NODE_ADDRESS=self.hosts.address(i), TRAIN_NODE_SECRET=SECRET)

    def up(self) -> Cluster:
        self.server = stacks.start_server(self.stack, self.logs / "server.log")
        stacks.wait_healthy(self.stack, self.server)
        stacks.create_pool(self.stack)
        stacks.deploy(self.stack)
        for i in range(self.hosts.count):
            self.start_worker(i)
        return self

    def start_worker(self, i: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", stacks.POOL, "--type", "process",
                   "--limit", "1", "--name", f"host{i}"]  # fmt: skip
        self.workers[i] = self.hosts.popen(i, command, self.node_env(i), self.logs / f"worker-host{i}.log", ROOT)
        return self.workers[i]

    def busy(self) -> dict[str, list[str]]:
        """Per host, the processes other than its worker (a flow run, torchrun, a rank...), as pid and command."""
        found: dict[str, list[str]] = {}
        for i in range(self.hosts.count):
            worker = self.workers[i].pid if i in self.workers else None
            others = [_describe(pid) for pid in self.hosts.pids(i) if pid != worker]
            if others:
                found[self.hosts.name(i)] = others
        return found

    def wait_idle(self, timeout: float = 60) -> dict[str, list[str]]:
        """Waits until no host runs anything but its worker; returns what still runs after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := self.busy()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def down(self) -> dict[str, list[int]]:
        """Stops the workers and the server, then removes the hosts; returns what had to be killed there."""
        for proc in self.workers.values():
            stacks.stop(proc, signal.SIGTERM, timeout=20)
        if self.server is not None:
            stacks.stop(self.server, signal.SIGTERM, timeout=20)
        return self.hosts.down()


def _describe(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return str(pid)
    return f"{pid} {command[:160]}"
