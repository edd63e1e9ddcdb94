"""How a gang ended, decided by the launcher from evidence, never by the last signal a surviving rank saw.

When a rank dies (SIGKILL, an OOM kill, a segfault), torchrun stops the others with a SIGTERM. A survivor waiting for
the dead rank (at a meeting point of a loop of its own, or at a step boundary) reads that SIGTERM as a stop request and
reports ``Preempted``: its view, not what happened. The launcher (the unit task's process) decides instead, once
torchrun has exited, from what it can check:

- whether this process itself was asked to stop first (a signal from outside the gang, a handover): a preemption;
- torchrun's failure record (the "Root Cause (first observed failure)" it prints: the rank, its exit code, the
  signal), and the ranks' own records in the gang's folder (``error-rank<r>.json``): a rank that exited by a signal,
  or without a record while the others left theirs, died — a crash of that rank (``RankDied``, retried like any
  crash), and the survivors' ``Preempted`` is torchrun's cleanup, part of that crash;
- else the first error a rank recorded, as before (typed: what must not be retried is not).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from training.distributed.errors import error_from_record
from training.exceptions import DistributedUnitError, RankDied
from training.preemption import Preempted

_ROOT = "Root Cause (first observed failure):"
_RANK = re.compile(r"\brank\s*: (\d+) \(local_rank: (\d+)\)")  # found anywhere in a line: a log prefix may precede it
_EXIT = re.compile(r"\bexitcode\s*: (-?\d+) \(pid: ")
MAX_LINES = 400  # torchrun's last lines kept (its failure record is printed last)


@dataclass(frozen=True)
class Death:
    """A rank that ended by itself without saying why: ``exitcode`` as torchrun reports it (negative: a signal)."""

    rank: int
    exitcode: int | None

    def describe(self) -> str:
        if self.exitcode is None:
            return f"rank {self.rank} died (no error recorded)"
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"rank {self.rank} died ({name}, exit {self.exitcode})"
        return f"rank {self.rank} died (exit {self.exitcode}, no error recorded)"


def rank_died(death: Death, step: int | None) -> RankDied:
    """The error of an attempt whose rank died: one line naming the rank, its exit and the last step reported."""
    return RankDied(
        f"{death.describe()}{f' after step {step}' if step is not None else ''}; torchrun stopped the other ranks "
        f"(their SIGTERM is part of this crash, not a preemption); a retry resumes from the last checkpoint",
        (death.rank, death.exitcode, step),
    )


def root_failure(lines: Iterable[str]) -> Death | None:
    """The rank and exit code of torchrun's "first observed failure", from its output; None if it printed none."""
    rank: int | None = None
    in_root = False
    for line in lines:
        if _ROOT in line:
            in_root, rank = True, None
        elif in_root and (m := _RANK.search(line)):
            rank = int(m.group(1))
        elif in_root and rank is not None and (m := _EXIT.search(line)):
            return Death(rank, int(m.group(1)))
    return None


def rank_records(folder: Path) -> dict[int, tuple[float, object]]:
    """The ranks' error records in the gang's folder: rank -> (time written, record)."""
    found: dict[int, tuple[float, object]] = {}
    for path in folder.glob("error-rank*.json"):
        rank = path.stem.removeprefix("error-rank")
        try:
            if rank.isdigit():
                found[int(rank)] = (path.stat().st_mtime, json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def dead_rank(lines: list[str], records: dict[int, tuple[float, object]], world: int, exited: bool) -> Death | None:
    """The rank that died, if the evidence says one did: torchrun's root cause with a signal's exit code or without a
    record of its own; else (torchrun printed none) a rank that left no record while others left theirs."""
    root = root_failure(lines)
    if root is not None and ((root.exitcode is not None and root.exitcode < 0) or root.rank not in records):
        return root
    if root is None and exited and records:
        silent = sorted(set(range(world)) - set(records))
        if silent:
            return Death(silent[0], None)
    return None


def verdict(
    folder: Path, lines: list[str], world: int, exited: bool, stopped_here: bool, what: str, code: int | None
) -> BaseException:
    """The error this attempt ends with. ``stopped_here``: this process was asked to stop (from outside the gang)
    before; ``exited``: torchrun exited by itself (not killed by this process)."""
    records = rank_records(folder)
    ordered = [record for _, record in sorted(records.values(), key=lambda item: item[0])]
    errors = [error_from_record(record) for record in ordered]
    if not stopped_here:
        death = dead_rank(lines, records, world, exited)
        if death is not None:
            steps = [e.step for e in errors if isinstance(e, Preempted)]
            return rank_died(death, max(steps) if steps else None)
        real = [e for e in errors if not isinstance(e, Preempted)]
        if real:  # a rank's own error; the others' stop was torchrun's cleanup
            return real[0]
    if errors:
        return errors[0]
    return DistributedUnitError(
        f"{what} (torchrun exit code {code}); all its processes were stopped (a retry resumes from the last checkpoint)"
    )
