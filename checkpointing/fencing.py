"""Writer generations: of two processes advancing one run, the older one stops.

Each run of the flow (a restart too) claims a generation under ``<run>/claims/`` with an exclusive
create (O_EXCL locally, a conditional put on S3). A commit first checks that no higher generation has
been claimed; a stale writer gets a FencedError naming who displaced it, and the newer writer logs whom
it displaced, so two trainings of one ``run_name`` never lose work silently.

Claims lie in the bucket, where anyone who may write it may write one: only names of 1-19 digits count (a
generation is an int64), a claim file is read bounded (untrusted.py) and each field typed, and a claim that is
not readable is still a claim of the generation its name gives, only without who made it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass

from checkpointing.manifest import Writer
from checkpointing.serialization import CheckpointError
from checkpointing.storage import Storage
from checkpointing.untrusted import MAX_CLAIM_BYTES, MAX_INT, MAX_LABEL, DamagedFileError, as_dict, printable, read_json

log = logging.getLogger(__name__)

CLAIMS = "claims"
_CLAIM_NAME = re.compile(r"^[0-9]{1,19}$")
_MAX_HOST = 255


class FencedError(CheckpointError):
    """A newer writer generation owns this run; this writer must stop."""


@dataclass(frozen=True)
class Claim:
    generation: int
    label: str = ""
    host: str = ""
    pid: int = 0
    claimed_at: float = 0.0

    def describe(self) -> str:
        age = f", {time.time() - self.claimed_at:.0f} s ago" if self.claimed_at else ""
        who = f"{self.label}, " if self.label else ""
        return f"generation {self.generation} ({who}host {self.host or '?'}, pid {self.pid or '?'}{age})"


class Fence:
    """The claims of one run folder."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def newest(self) -> int:
        names = self.storage.sizes(CLAIMS) if self.storage.exists(CLAIMS) else {}
        generations = (int(n) for n in names if _CLAIM_NAME.match(n))  # ASCII digits: str.isdigit takes '²' too
        return max((g for g in generations if g <= MAX_INT), default=0)

    def read(self, generation: int) -> Claim:
        """Who claimed ``generation``, as far as its file says; fields that are missing or not of their type
        (or a file that is not a claim at all) leave that part of the description blank."""
        try:
            raw = as_dict(read_json(self.storage, f"{CLAIMS}/{generation:012d}", MAX_CLAIM_BYTES), "the claim")
        except (FileNotFoundError, DamagedFileError):
            return Claim(generation=generation)
        label, host, pid, claimed_at = (raw.get(k) for k in ("label", "host", "pid", "claimed_at"))
        return Claim(
            generation=generation,
            label=printable(label)[:MAX_LABEL] if isinstance(label, str) else "",  # it goes into log lines
            host=printable(host)[:_MAX_HOST] if isinstance(host, str) else "",
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_INT else 0,
            claimed_at=_time(claimed_at),
        )

    def claim(self, floor: int, label: str = "") -> int:
        """Claims a generation above ``floor`` and every claim so far; logs the writer it displaces."""
        previous = self.newest()
        generation = max(previous, floor) + 1
        label = label[:MAX_LABEL]
        for _ in range(100):
            me = Writer.current(generation, label)
            body = {"generation": generation, "label": label, "host": me.host, "pid": me.pid, "claimed_at": time.time()}
            if self.storage.create(f"{CLAIMS}/{generation:012d}", json.dumps(body).encode()):
                if previous:
                    log.info(
                        "%s: claimed writer generation %d; the previous writer was %s. If that one is still "
                        "running, its next commit will be refused (two trainings of one run_name).",
                        self.storage.url,
                        generation,
                        self.read(previous).describe(),
                    )
                return generation
            generation += 1
        raise FencedError(f"{self.storage.url}: could not claim a writer generation (100 concurrent claims?)")

    def check(self, writer: Writer, pointer_generation: int) -> None:
        newest = max(self.newest(), pointer_generation)
        if newest > writer.generation:
            raise FencedError(
                f"{self.storage.url}: a newer writer, {self.read(newest).describe()}, has claimed this run; this "
                f"writer (generation {writer.generation}, host {writer.host}, pid {writer.pid}) is stale and stops "
                f"without writing. Two trainings of one run_name were running; the newer one carries on from the "
                f"latest checkpoint."
            )


def _time(value: object) -> float:
    """A claim's time, or 0.0 (unknown) for anything but a finite, non-negative number."""
    try:
        seconds = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        return 0.0
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0
