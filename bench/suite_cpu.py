"""Where a command's CPU goes, by program: every process it starts, however short-lived, counted at its exit.

    sudo .venv/bin/python -m bench.suite_cpu --venv /path/to/clone/.venv -- make -C /path/to/clone test

Linux's BSD process accounting (``acct(2)``, root) writes one record per process that exits: its pid, start time
and user + system CPU. Only its first 15 characters of name come with it (``python``), so for the program a
``sitecustomize.py`` put in the venv for the run logs each Python process's pid and command line at its start
(removed after). A process forked without exec (a loader worker) keeps its parent's name (``pt_data_worker``) and is
listed as unlogged. The figures are CPU seconds, not wall time: on a CPU-bound suite the wall time follows their sum.
Nothing is appended to RESULTS.md: the report is printed, for the reader to record with the command.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_SITECUSTOMIZE = """import os, time
try:
    _a = open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")[:300]
    with open({log!r}, "a") as _f:
        _f.write(f"{{os.getpid()}}\\t{{time.time():.2f}}\\t{{_a!r}}\\n")
except Exception:
    pass
"""
_RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (linux/acct.h), 64 bytes


def _acct(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        raise SystemExit(f"acct({path}): {os.strerror(ctypes.get_errno())} (process accounting needs root)")


def _seconds(comp_t: int) -> float:
    return ((comp_t & 0x1FFF) << (3 * ((comp_t >> 13) & 7))) / 100  # comp_t: 13-bit mantissa, base-8 exponent; AHZ 100


def program(cmdline: str) -> str:
    """A process's program from its command line: ``python -m MODULE``, a ``-c`` script's kind, or the script."""
    words = cmdline.split()
    if "-m" in words[:4] and words.index("-m") + 1 < len(words):
        rest = words[words.index("-m") + 1 :]
        if rest[0] == "prefect":  # its subcommand: a server's CPU is not a CLI call's
            rest = [rest[0], *[w for w in rest[1:] if not w.startswith("-")][:2]]
            return "python -m " + " ".join(rest)
        return f"python -m {rest[0]}"
    if "-c" in words[:4]:
        code = cmdline.split(" -c ", 1)[-1]
        return "pytest-xdist worker" if "exec(eval" in code else "python -c (a script)"
    return " ".join(w.rsplit("/", 1)[-1] for w in words[:2])


def report(pacct: Path, log: Path, top: int = 30) -> str:
    started: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    for line in log.read_text().splitlines():
        pid, at, cmd = line.split("\t", 2)
        started[int(pid)].append((float(at), cmd.strip("'\"")))
    cpu: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    data = pacct.read_bytes()
    for offset in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        fields = _RECORD.unpack_from(data, offset)
        pid, btime, utime, stime, comm = fields[6], fields[8], fields[10], fields[11], fields[-1]
        runs = [cmd for at, cmd in started.get(pid, []) if at <= btime + 2]  # pids are reused: the latest start
        name = comm.split(b"\0")[0].decode(errors="replace")
        what = program(runs[-1]) if runs else f"unlogged: {name}"
        cpu[what] += _seconds(utime) + _seconds(stime)
        count[what] += 1
    total = sum(cpu.values())
    lines = [
        f"{total:.0f} CPU s in {sum(count.values())} processes",
        "",
        "| program | processes | CPU s | share | CPU s each |",
    ]
    lines.append("| --- | --- | --- | --- | --- |")
    for what, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(
            f"| {what} | {count[what]} | {seconds:.0f} | {seconds / total:.0%} | {seconds / count[what]:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suite_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", required=True, help="the venv whose Python processes are logged by program")
    parser.add_argument("--keep", help="a folder to keep the raw accounting file and the start log in")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run (make test, pytest ...)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --")
    folder = Path(args.keep or tempfile.mkdtemp(prefix="suite-cpu-"))
    folder.mkdir(parents=True, exist_ok=True)
    pacct, log = folder / "pacct", folder / "starts.log"
    pacct.touch()
    log.touch()
    site = next(Path(args.venv).glob("lib/python*/site-packages"))
    custom = site / "sitecustomize.py"
    if custom.exists():
        raise SystemExit(f"{custom} exists: not overwritten (use a fresh clone's venv)")
    custom.write_text(_SITECUSTOMIZE.format(log=str(log)))
    t0 = time.monotonic()
    _acct(str(pacct))
    try:
        rc = subprocess.call(command)
    finally:
        _acct(None)
        custom.unlink()
    print(f"\n`{' '.join(command)}` exited {rc} after {time.monotonic() - t0:.0f} s; {os.cpu_count()} CPUs")
    print(report(pacct, log))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
