"""What the tests read of running processes from /proc (Linux): alive, children, command line. Process trees below a
pid: ``deployments.stack.descendants``."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first, then the parent pid)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat_fields(entry.name)[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` (empty once it is gone); a child forked by Popen shows its parent's until it has
    exec'd, and Popen waits for that exec: a child stopped before it would stop the parent too."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def environ(pid: int | str) -> bytes:
    """The environment of ``pid``, NUL-separated (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def this_worker(environ_entries: list[bytes]) -> bool:
    """Whether a process with this environment was started from this pytest process's tree: under pytest-xdist it
    carries this worker's ``PYTEST_XDIST_WORKER`` (inherited), so a scan of all /proc never counts another worker's
    processes. Always true when the suite runs in one process."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return worker is None or f"PYTEST_XDIST_WORKER={worker}".encode() in environ_entries


def ranks_of(pid: int) -> list[int]:
    """The torchrun rank processes (``training.distributed.rank``) below ``pid``."""
    from deployments.stack import descendants

    return [p for p in descendants(pid) if b"training.distributed.rank" in cmdline(p) and b"torch.distributed" not in
            cmdline(p)]  # fmt: skip


def wait_until(predicate, proc, what: str, timeout: float = 180, poll: float = 0.05) -> None:
    """Polls ``predicate`` until it holds; fails if ``proc`` ended or ``timeout`` seconds (scaled by the load:
    tests/deadlines.py) passed first."""
    import time

    from tests.deadlines import deadline

    end = deadline(timeout)
    while not predicate():
        assert proc.poll() is None and time.monotonic() < end, f"never saw {what} (TEST_TIME_SCALE scales the wait)"
        time.sleep(poll)


def group_gone(pgid: int) -> bool:
    """No process of process group ``pgid`` is left but zombies (which map nothing and hold no file)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = _stat_fields(entry.name)  # state, ppid, pgrp, ...
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return False
    return True
