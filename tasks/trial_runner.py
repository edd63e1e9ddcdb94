"""Warm trial runners: a sweep's K long-lived trial processes, each handed one segment at a time (issue 46).

A trial's segment is an ordinary run (flows/sweep_trial.py: its own flow run, its own ``run_name``); started as a
fresh ``python -m flows.sweep_trial`` process it paid the interpreter's start, torch's and Prefect's imports and
Prefect's client set-up every time (46 % of a segment's wall time in the sweep bench). A runner pays them once: it is
``python -m flows.sweep_trial <its spec file> --warm``, reading one line (``run``) on its stdin per segment, running the
segment described by its spec file exactly as a fresh process would (after ``training.process_state.reset()``, which
forgets everything a run leaves in a process), and ending what it printed on stderr with one line
``<DONE_MARK> <exit code>``: the exit code a fresh process would have exited with, so tasks/trial.py reads the
outcome the same way (exit code + the stderr tail).

Lifetime. A runner dies with the sweep: it is started with PR_SET_PDEATHSIG (SIGKILL when its parent thread ends),
which the kernel enforces even while the runner is deep in a training step and reads nothing — a pipe's EOF would be
seen only when the runner reads it. The kernel's "parent" is the *thread* that forked; runners are forked from the
sweep's task threads, which live until the sweep's task runner shuts down, and the sweep closes its runners before
that (``Sweep.run``). The pipe is the orderly end: closing a runner's stdin makes it leave its loop and exit.
A runner that dies mid-segment reads as a process that died (exit code < 0): the task's retry resumes the run from
its checkpoint in a new runner. Segments of the same run go to the runner that ran its last segment where it is free.

Files. A sweep's trial files (each runner's spec, each segment's spec and result) live in one private folder,
``<tmp>/sweep-runners-<sweep pid>-<random>``, removed when the sweep ends. A SIGKILLed sweep cannot remove it; the
next sweep on the machine (its relaunch, or any other) removes every such folder of this user whose sweep process is
gone. Not under the sweep's own folder: that may be a bucket, and a spec is read by a process, not a store. A folder
whose pid was reused by another process is kept until that process ends too (never one of a live sweep).
``SWEEP_PROCESS_PER_SEGMENT=1`` keeps the folder and starts a fresh process per segment instead of runners.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from training.lifetimes import die_with_parent_now, remove_stale_folders

DONE_MARK = "\x1esweep-runner-segment-done"  # the runner's last stderr line of a segment: "<mark> <exit code>"
WARM_FLAG = "--warm"
PROCESS_PER_SEGMENT_ENV = "SWEEP_PROCESS_PER_SEGMENT"  # internal switch: "1" = a fresh process per segment (tests)
_CLOSE_SECONDS = 30.0  # how long a runner whose stdin closed may take to ship its logs and exit
FOLDER_PREFIX = "sweep-runners-"  # <tmp>/sweep-runners-<sweep pid>-<random>: one sweep's trial files
_ENDED_UNREPORTED = -1  # a runner that exited without its mark line mid-segment: read as a process that died


class Runner:
    """One warm trial process: its stdin (segments in), its stderr read by a thread into a queue (lines out)."""

    def __init__(self, spec: str, env: dict[str, str]):
        self.spec, self.env = spec, env
        self.last_run: str | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.sweep_trial", spec, WARM_FLAG],
            env=env,
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=functools.partial(die_with_parent_now, os.getpid()),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"trial-runner-{self.proc.pid}", daemon=True).start()

    def _read(self) -> None:
        """Every stderr line: passed through to ours (except the mark) and queued; None at EOF (the runner ended)."""
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            if not line.startswith(DONE_MARK):
                sys.stderr.write(line)
            self.lines.put(line)
        self.lines.put(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, payload: dict[str, Any]) -> tuple[int, str]:
        """Runs one segment: its exit code (negative: the runner died, by that signal) and its stderr's tail."""
        while not self.lines.empty():  # what it printed while idle belongs to no segment
            if self.lines.get_nowait() is None:
                return self.proc.wait() or _ENDED_UNREPORTED, ""
        temporary = f"{self.spec}.part"
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(payload, f)
        os.replace(temporary, self.spec)
        kept: list[str] = []
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"run\n")
            self.proc.stdin.flush()
        except OSError:  # it died while idle: its EOF is queued
            pass
        while (line := self.lines.get()) is not None:
            if line.startswith(DONE_MARK):
                with contextlib.suppress(OSError):
                    os.unlink(self.spec)  # an idle runner names no run (tests find a run's process by its spec)
                return int(line[len(DONE_MARK) :].strip()), "".join(kept)
            kept.append(line)
            del kept[:-50]
        return self.proc.wait() or _ENDED_UNREPORTED, "".join(kept)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()


class RunnerPool:
    """The sweep's runners: at most ``size`` idle ones kept; a segment takes a free one (the one that ran its run
    before, if free), else a new one. Open only while a sweep runs (``opened``), with its folder; closed, or with
    SWEEP_PROCESS_PER_SEGMENT=1, a segment runs in a fresh process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Runner] = []
        self._busy: set[Runner] = set()
        self._folder: str | None = None
        self._warm = False
        self._size = 0
        self._count = 0  # runners started (this sweep's trial processes)
        self._segments = 0  # segments handed to them

    @property
    def is_open(self) -> bool:
        """Segments run in warm runners now."""
        return self._folder is not None and self._warm

    @property
    def folder(self) -> str | None:
        """The open sweep's private folder for its trial files (None outside a sweep)."""
        return self._folder

    @contextlib.contextmanager
    def opened(self, size: int) -> Iterator[RunnerPool]:
        """Runners for one sweep: ``size`` (max_concurrent_trials) at most kept; all closed, and the sweep's folder
        removed, at the end. The folders of sweeps that were killed are removed first."""
        remove_stale_folders(FOLDER_PREFIX)  # the folders of sweeps that were SIGKILLed
        with self._lock:
            if self._folder is not None:
                raise RuntimeError("a sweep's trial runners are already open in this process")
            self._folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
            self._warm, self._size = os.environ.get(PROCESS_PER_SEGMENT_ENV) != "1", size
            self._count = self._segments = 0
        try:
            yield self
        finally:
            self.close()

    def run(self, payload: dict[str, Any], env: dict[str, str], run_name: str, track: Any) -> tuple[int, str]:
        """One segment in a warm runner: the exit code and stderr tail a fresh trial process would have given.
        ``track`` (tasks/trial.py's CHILDREN) holds the runner's process while the segment runs."""
        runner = self._take(env, run_name)
        track.add(runner.proc)
        try:
            return runner.run(payload)
        finally:
            track.discard(runner.proc)
            self._give_back(runner, run_name)

    def _take(self, env: dict[str, str], run_name: str) -> Runner:
        with self._lock:
            if self._folder is None or not self._warm:
                raise RuntimeError("the sweep's trial runners are closed: the sweep is ending")
            for dead in [r for r in self._idle if not r.alive()]:
                self._idle.remove(dead)
            fits = [r for r in self._idle if r.env == env]
            runner = next((r for r in fits if r.last_run == run_name), fits[0] if fits else None)
            if runner is None:
                while self._idle and len(self._idle) + len(self._busy) >= self._size:
                    self._idle.pop(0).close()  # another environment's runner: at most `size` processes
                self._count += 1
                runner = Runner(os.path.join(self._folder, f"runner-{self._count}.json"), env)
            else:
                self._idle.remove(runner)
            self._busy.add(runner)
            self._segments += 1
            return runner

    def _give_back(self, runner: Runner, run_name: str) -> None:
        with self._lock:
            self._busy.discard(runner)
            runner.last_run = run_name
            if runner.alive() and self._folder is not None:
                self._idle.append(runner)
            else:
                runner.close()

    def close(self) -> None:
        """Closes every runner's stdin (each leaves its loop and exits), waits, and SIGKILLs what is left."""
        with self._lock:
            runners, folder = [*self._idle, *self._busy], self._folder
            self._idle, self._busy, self._folder = [], set(), None
        if folder and self._segments:
            print(f"sweep: {self._segments} trial segment(s) ran in {self._count} warm trial process(es)", flush=True)
        for runner in runners:
            runner.close()
        for runner in runners:
            try:
                runner.proc.wait(timeout=_CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                runner.proc.kill()
                runner.proc.wait()
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


RUNNERS = RunnerPool()
