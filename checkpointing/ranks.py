"""Agreement between the ranks of a process group on checkpoint steps that may fail on some ranks only.

A rank that raises while the others wait in a collective hangs the job until its timeout. Each step here
runs on every rank (or on rank 0), shares the outcome, and then every rank returns or raises the same
error: a CorruptCheckpointError seen by rank 1 alone still makes rank 0 fall back. Without a process group
(one process) the steps simply run.

Collectives assume every rank calls them; a user's loop may not (Ray's habit of reporting on rank 0 only), and then
rank 0 waits in one collective while rank 1 is in another (DDP's), both for ever. ``meet`` is the check before them:
the ranks say where they are through the process group's key-value store, which never mixes with collectives, and a
rank gives up after a timeout or when asked to stop, with where each rank was.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
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


# -- meeting points: every rank at the same call of the same verb, or a clear error (never a hang) ----------------


@dataclass(frozen=True)
class Meeting:
    """Where each rank stood at a meeting point: ``points[r]`` is the point rank ``r`` reached (None: it did not
    arrive in time). ``stopped``: the wait ended because a stop was requested; ``failed``: another rank's error."""

    points: dict[int, str | None]
    stopped: bool = False
    failed: str | None = None

    @property
    def missing(self) -> list[int]:
        return [r for r, point in self.points.items() if point is None]

    @property
    def agreed(self) -> bool:
        return not self.missing and len(set(self.points.values())) == 1 and self.failed is None


def meet(
    key: str,
    point: str,
    timeout: float,
    stopped: Callable[[], bool] = lambda: False,
    on_slow: Callable[[list[int]], None] | None = None,
    slow_after: float = 5.0,
) -> Meeting:
    """Every rank says which ``point`` it reached as its call ``key`` (the same key on every rank: a count of such
    calls), then waits for the others' word, through the process group's key-value store, not a collective: a rank
    that never comes (it is in a collective of its own, or past the loop) cannot make this one hang. Returns once
    every rank has spoken, or after ``timeout`` seconds, or soon after ``stopped()`` turns true (a stop is honoured
    while ranks wait); ``on_slow(missing)`` is called once after ``slow_after`` seconds. A rank that gives up calls
    ``fail`` so that the others, when they come, learn why. Without a process group every rank is this one."""
    world = group()
    if world is None:
        return Meeting({0: point})
    rank, size = world
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{rank}", point)
    keys = [f"{key}/{r}" for r in range(size)]
    failed = _failed_key(key)
    t0 = time.monotonic()
    pause, warned, stop_at = 0.0005, False, None
    while True:
        if store.check([failed]):
            return Meeting(_points(store, keys), failed=store.get(failed).decode())
        if store.check(keys):
            return Meeting(_points(store, keys))
        now = time.monotonic()
        if stop_at is None and stopped():
            stop_at = now  # the others normally come within milliseconds: give them a moment, then leave
        if stop_at is not None and now - stop_at > _STOP_PATIENCE:
            return Meeting(_points(store, keys), stopped=True)
        if now - t0 > timeout:
            return Meeting(_points(store, keys))
        if not warned and on_slow is not None and now - t0 > slow_after:
            warned = True
            on_slow([r for r, p in _points(store, keys).items() if p is None])
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def fail(key: str, message: str) -> None:
    """Tells every rank that meets at ``key``'s family later that this one gave up, and why."""
    if group() is not None:
        dist.distributed_c10d._get_default_store().set(_failed_key(key), message)


def failure(family: str) -> str | None:
    """Why a rank gave up at a meeting point of ``family`` (``fail``), or None; a quick look, no waiting."""
    if group() is None:
        return None
    store, key = dist.distributed_c10d._get_default_store(), f"{family}/failed"
    return store.get(key).decode() if store.check([key]) else None


_STOP_PATIENCE = 2.0  # seconds a stopping rank still waits for the others at a meeting point


def _failed_key(key: str) -> str:
    return key.rsplit("/", 1)[0] + "/failed"  # one per family (``<family>/<call>``)


def _points(store: Any, keys: list[str]) -> dict[int, str | None]:
    return {r: store.get(k).decode() if store.check([k]) else None for r, k in enumerate(keys)}
