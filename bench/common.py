"""Shared bench helpers: machine facts, the results file, medians, an isolated Prefect, a local S3 server,
and a log recorder that times the product from outside (by the timestamps of its own log lines)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Set
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
TIER_ENV = "TRAIN_HOST_TIER_DIR"  # checkpointing.host_tier.tier.ROOT_ENV, not imported: this module imports no product
OUT = Path(__file__).with_name("out")  # profiles and scratch files (git-ignored)
NOISE = (
    "Shared machine: 2 cores used by other engineers' builds and tests while this ran (load average "
    "{load}); ratios come from variants alternated within this one run, medians of the repetitions."
)


# -- reporting ------------------------------------------------------------------------------------
def machine() -> str:
    import torch

    try:
        import prefect

        prefect_version = f"prefect {prefect.__version__}"
    except ImportError:  # a bare GPU machine: the benchmarks that need no Prefect still record
        prefect_version = "no prefect"

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} cores, "
        f"{mem:.0f} GiB; Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {prefect_version}"
    )


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def command_line() -> str:
    """The exact command that produced the figures (and the make line, when make ran it)."""
    cmd = f"`python -m bench {shlex.join(sys.argv[1:])}`"
    return f"{cmd} (run by `make bench`)" if os.environ.get("MAKELEVEL") else cmd


def record(title: str, lines: list[str], load_at_start: str) -> None:
    """Prints the figures and appends them, with the command and machine facts, to bench/RESULTS.md (not with
    BENCH_NO_RECORD=1)."""
    block = [
        f"## {title}",
        "",
        f"{command_line()} — {machine()}",
        "",
        NOISE.format(load=f"{load_at_start} at start, {load_average()} at end"),
        "",
        *lines,
        "",
    ]
    print("\n".join(block), flush=True)
    if os.environ.get("BENCH_NO_RECORD"):  # a trial run: figures on the terminal only
        return
    with RESULTS.open("a") as f:
        f.write("\n".join(block) + "\n")


def progress(message: str) -> None:
    """A line on stderr while a benchmark runs (load average included: a jump explains an outlier)."""
    print(f"  [{time.strftime('%H:%M:%S')} load {load_average()}] {message}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max, n)' for a table cell."""
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def rotated(items: list, rep: int) -> list:
    """Alternation: each repetition starts one variant later, so no variant always runs first."""
    k = rep % len(items)
    return items[k:] + items[:k]


def parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"python -m bench {name}", description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


# -- environment ----------------------------------------------------------------------------------
def free_port() -> int:
    """A free loopback port (flows.server's; imported here, not at the top: it needs Prefect)."""
    from flows.server import free_port as free

    return free()


_SCRATCH: list[str] = []


def scratch(prefix: str) -> str:
    """A new temporary folder under this process's scratch folder, which is removed when the process exits
    (checkpoints of ~200 MB add up fast)."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="bench-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[0])


def leave_nothing_behind() -> None:
    """For ``python -m bench``'s own process: a SIGTERM (``pkill``, a closed terminal's hang-up aside) ends it through
    its ``finally`` blocks and ``atexit`` (the scratch folder above), not at once; and the host-memory tier of every
    run it trains, in process or in a child, lives in a folder of its own under /dev/shm, removed at exit. Without
    this, a benchmark stopped mid-unit left its runs' snapshot slots in /dev/shm (2.1 GB for the 1 GB GPT: a killed
    run's tier is kept for its relaunch, which a benchmark's scratch run never gets). A TRAIN_HOST_TIER_DIR the
    caller set is kept as it is."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if os.environ.get(TIER_ENV):
        return
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the tier's default file system, where there is one
    tier = tempfile.mkdtemp(prefix="bench-tier-", dir=parent)  # mode 0700, as the tier requires
    atexit.register(shutil.rmtree, tier, ignore_errors=True)
    os.environ[TIER_ENV] = tier


def isolate_prefect() -> str:
    """A throw-away PREFECT_HOME, no analytics; the product's INFO log lines reach the recorder, not the console."""
    home = scratch("prefect-home-")
    os.environ["PREFECT_HOME"] = home
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"  # the product's default: its log lines are part of its cost
    os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "WARNING"
    for key in [k for k in os.environ if k.startswith("TRAIN_")]:
        del os.environ[key]
    return home


class LocalS3:
    """``make s3``'s moto server (deployments/local_s3.py) on a free loopback port, in a child process of its own.

    In its own process the server does not hold this process's GIL while it parses an upload, which is
    closer to a store on another machine; it still shares the 2 cores with training."""

    def __init__(self) -> None:
        import deployments.local_s3 as local_s3_server  # moto and Prefect: imported only when a benchmark needs S3

        os.environ.update(local_s3_server.fake_aws_env("bench", "bench-secret"))
        for key in local_s3_server.AWS_UNSET:
            os.environ.pop(key, None)
        self.server = local_s3_server.LocalS3(free_port())
        self.port, self.endpoint, self.options = self.server.port, self.server.endpoint, self.server.storage_options
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.local_s3"],
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "LOCAL_S3_PORT": str(self.port)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)

    def fresh_bucket(self, name: str) -> str:
        """Empties the server (frees the memory of earlier runs) and creates bucket ``name``: its URL."""
        return self.server.fresh_bucket(name)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)


@contextlib.contextmanager
def local_s3():
    server = LocalS3()
    try:
        yield server
    finally:
        server.close()


# -- timing the product from outside --------------------------------------------------------------
class LogRecorder(logging.Handler):
    """Keeps (time, CPU time, message) of every record of the given loggers: the product's log lines are the clock."""

    def __init__(self, *names: str) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[tuple[float, float, str]] = []
        self._loggers = [logging.getLogger(n) for n in names]

    def __enter__(self) -> LogRecorder:
        for logger in self._loggers:
            logger.addHandler(self)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        for logger in self._loggers:
            logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        # emit runs in the thread that logged, right away: this process's CPU clock is read at the same moment
        self.records.append((record.created, time.process_time(), record.getMessage()))

    def first(self, pattern: str) -> tuple[float, float]:
        """(wall time, this process's CPU time) of the first line matching the regex ``pattern``."""
        import re

        for t, cpu, msg in self.records:
            if re.search(pattern, msg):
                return t, cpu
        raise LookupError(f"no log line matched {pattern!r}; got: {[m for *_, m in self.records][:20]}")


# -- where CPU time goes: this process's threads and its child processes --------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds (0 if it is gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _group(name: str) -> str:
    if name == "MainThread":
        return "main thread (training, stall)"
    if name.startswith(("checkpoint-", "storage-")):
        return "checkpoint threads (upload, hashing)"
    if name.startswith("fsspec"):
        return "fsspec I/O loop (s3fs requests)"
    if name == "native":
        return "native threads (torch's OpenMP workers)"
    return "other Python threads (Prefect client: logs, events)"


def cpu_by_thread_group() -> dict[str, float]:
    """CPU seconds so far of this process's threads, grouped by what they do (Python thread names)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        group = _group(names.get(int(tid), "native"))
        out[group] = out.get(group, 0.0) + _proc_cpu(f"/proc/self/task/{tid}/stat")
    return out


def children_cpu(exclude: Set[int] = frozenset()) -> float:
    """CPU seconds so far of this process's child processes (and theirs), except ``exclude`` and their children."""
    me, total = os.getpid(), 0.0
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    for pid in parents:
        if pid == me:
            continue
        chain: set[int] = set()
        p = pid
        while p in parents and p != me and p not in chain:
            chain.add(p)
            p = parents[p]
        if p == me and not (chain & set(exclude)):
            total += _proc_cpu(f"/proc/{pid}/stat")
    return total
