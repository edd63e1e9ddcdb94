"""Whole processes, timed from outside: a Prefect server the benchmark holds, the environment of a child, the wall
time of one process and the timestamps of the product's own log lines in its output."""

from __future__ import annotations

import compileall
import contextlib
import datetime
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flows.server import TemporaryServer, free_port

ROOT = Path(__file__).resolve().parents[1]
_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \| \w+\s*\| (.*)$")
_UNIT_DONE = re.compile(
    r"unit (\d+) done: train_loss ([\d.]+), (\d+) samples/s, checkpoint \S+ \([\d.]+ MB\) committed in ([\d.]+)s"
)


@dataclass
class Process:
    """One finished process: its wall time, CPU time (with the children it waited for: a temporary Prefect server,
    torchrun and its ranks), output, and when it started (epoch seconds)."""

    wall: float
    cpu: float
    output: str
    start: float

    def lines(self) -> list[tuple[float, str]]:
        """(seconds since the process started, message) of each timestamped log line of the product."""
        day = datetime.datetime.fromtimestamp(self.start).date()
        found = []
        for line in self.output.splitlines():
            if m := _LINE.match(line):
                t = datetime.datetime.combine(day, datetime.time.fromisoformat(m.group(1))).timestamp()
                if t < self.start - 3600:  # past midnight
                    t += 86400
                found.append((t - self.start, m.group(2)))
        return found

    def first(self, pattern: str) -> float:
        """Seconds since the start of the first log line matching ``pattern``."""
        for t, message in self.lines():
            if re.search(pattern, message):
                return t
        raise LookupError(f"no log line matched {pattern!r}: {self.output[-1500:]}")

    def units_done(self) -> list[tuple[float, float, float, float]]:
        """Per unit, from its 'unit k done' line: (seconds since start, train_loss, samples/s, checkpoint seconds)."""
        return [(t, float(m.group(2)), float(m.group(3)), float(m.group(4)))
                for t, message in self.lines() if (m := _UNIT_DONE.search(message))]  # fmt: skip


def run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> Process:
    before, start, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time(), time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Process(wall, cpu, done.stdout + done.stderr, start)


def child_env(threads: int, **extra: str) -> dict[str, str]:
    """A child's environment: no TRAIN_* or PREFECT_API_URL of ours, a PREFECT_PORT nothing listens on (so that no
    server someone else runs on 4200 is found and used), the product's log lines on the console (Prefect's default
    INFO level, timestamped), ``threads`` torch threads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_") and k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(ROOT), PREFECT_PORT=str(free_port()), PREFECT_LOGGING_LEVEL="INFO",
               PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="INFO", OMP_NUM_THREADS=str(threads))  # fmt: skip
    env.update(extra)
    return env


@contextlib.contextmanager
def held_server() -> Iterator[str]:
    """A Prefect server for the benchmark's whole run (its API URL): the 'running server' of the variants."""
    server = TemporaryServer()
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


def compile_bytecode() -> None:
    """Writes the project's bytecode once, as an installed package has it: with PYTHONDONTWRITEBYTECODE set (it is
    here) every process would compile the changed modules again, the product's more than a bare script's."""
    for package in ("flows", "tasks", "training", "checkpointing", "recipes", "bench"):
        compileall.compile_dir(ROOT / package, quiet=1)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]
