"""Writer generations: of two processes advancing one run, the older one stops.

Each run of the flow (a restart too) claims a generation under ``<run>/claims/`` with an exclusive
create (O_EXCL locally, a conditional put on S3). A commit first checks that no higher generation has
been claimed; a stale writer gets a FencedError naming who displaced it, and the newer writer logs whom
it displaced, so two trainings of one ``run_name`` never lose work silently.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from checkpointing.manifest import Writer
from checkpointing.serialization import CheckpointError
from checkpointing.storage import Storage

log = logging.getLogger(__name__)

CLAIMS = "claims"


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
        return max((int(n) for n in names if n.isdigit()), default=0)

    def read(self, generation: int) -> Claim:
        try:
            raw: dict[str, Any] = json.loads(self.storage.get(f"{CLAIMS}/{generation:012d}"))
            return Claim(
                generation=generation,
                label=str(raw.get("label", "")),
                host=str(raw.get("host", "")),
                pid=int(raw.get("pid", 0)),
                claimed_at=float(raw.get("claimed_at", 0.0)),
            )
        except (FileNotFoundError, ValueError, TypeError):
            return Claim(generation=generation)

    def claim(self, floor: int, label: str = "") -> int:
        """Claims a generation above ``floor`` and every claim so far; logs the writer it displaces."""
        previous = self.newest()
        generation = max(previous, floor) + 1
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
