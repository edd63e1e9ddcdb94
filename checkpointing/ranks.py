"""Agreement between the ranks of a process group on checkpoint steps that may fail on some ranks only.

A rank that raises while the others wait in a collective hangs the job until its timeout. Each step here
runs on every rank (or on rank 0), shares the outcome, and then every rank returns or raises the same
error: a CorruptCheckpointError seen by rank 1 alone still makes rank 0 fall back. Without a process group
(one process) the steps simply run.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from checkpointing.errors import CheckpointError

T = TypeVar("T")


def group() -> tuple[int, int] | None:
    """(rank, world size) when a process group is up; None in a single process without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _portable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return CheckpointError(f"{type(exc).__name__}: {exc}")


def on_every_rank(fn: Callable[[], T]) -> T:
    """Runs ``fn`` on every rank; if it failed anywhere, every rank raises (so none waits in a collective)."""
    try:
        result, error = fn(), None
    except Exception as exc:
        result, error = None, exc
    world = group()
    if world is not None:
        errors: list[Any] = [None] * world[1]
        dist.all_gather_object(errors, None if error is None else _portable(error))
        error = error or next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return result  # type: ignore[return-value]


def on_rank0(fn: Callable[[], T]) -> T:
    """Runs ``fn`` on rank 0 and hands every rank its result, or its error."""
    world = group()
    if world is None:
        return fn()
    box: list[Any] = [None]
    if world[0] == 0:
        try:
            box[0] = (fn(), None)
        except Exception as exc:
            box[0] = (None, _portable(exc))
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


def gather_to_rank0(value: T) -> list[T]:
    """Every rank's ``value`` (its file entries, its RNG state), on rank 0 (others get an empty list). Cannot fail on
    one rank only."""
    world = group()
    if world is None:
        return [value]
    everyone: list[Any] | None = [None] * world[1] if world[0] == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone or []
