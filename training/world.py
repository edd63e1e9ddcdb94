"""``World``: this process's place among the processes that train one unit together (rank, size, local rank).

A leaf: the session, the checkpointer, the metrics writers and the ranks all take one, and none of them has to import
another to name it.
"""

from __future__ import annotations

from dataclasses import dataclass


def rng_file(rank: int) -> str:
    """The file of a checkpoint that holds this rank's random-number state."""
    return f"rng-rank{rank}.pt"


@dataclass(frozen=True)
class World:
    """This process's place among the processes that train one unit together."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def rng_file(self) -> str:
        return rng_file(self.rank)


SINGLE_PROCESS = World()
