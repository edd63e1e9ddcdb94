"""A stateful stream read by worker processes: torchdata's ``StatefulDataLoader``, and the check of its saved state.

torch's DataLoader cannot say where its workers' iterators are; torchdata's ``StatefulDataLoader`` can: each worker
sends its copy of the stream's ``state_dict()`` with every sample (``snapshot_every_n_steps=1``), and the loader's
``state_dict()`` is every worker's state and which worker yields next. Read one sample at a time (``batch_size=None``:
the product's loader makes the micro-batches, of any size), that state is exact after any sample, so it is the
position a checkpoint saves (training/position/iterable.py). torchdata is imported only here, only for a stateful
stream with ``num_workers > 0`` (``pip install 'resumable-train[streams]'``).

A worker's random generators (torch's, Python's ``random``, NumPy's global one) are not in that state: torch seeds
them once, when the worker starts. ``SeededStream`` seeds them again before each sample the worker reads, from the
run's seed, the rank, the worker and how many samples that worker has read (training/position/worker_seeds.py), and
that count is in the worker's state: a stream that draws random numbers while it makes a sample (augmentation)
resumes with the numbers an uninterrupted run's workers draw.

The state comes back from the store: ``check_loader_state`` accepts only the shape this module writes (the worker
count, the keys, plain values, bounded) before torchdata sees it; anything else is one ``DataError``. What a worker's
stream state holds is the stream's own business, as with ``num_workers=0``.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch

from training.config import ConfigError
from training.exceptions import DataError
from training.lifetimes import die_with, remove_orphaned_semaphores_once
from training.position.worker_seeds import seed_generators

MAX_NODES = 100_000  # values in one rank's saved loader state (a worker's stream state is a few dozen)
MAX_DEPTH = 32
MAX_PREFETCH = 128  # samples in flight per worker: about one step's share, at most this many
_TOP = {"_snapshot", "_steps_since_snapshot", "_iterator_finished"}
_SNAPSHOT = {"_snapshot_step", "_last_yielded_worker_id", "_main_snapshot", "_worker_snapshots"}
_WORKER = {"worker_id", "dataset_state", "fetcher_state"}
_SEEDED = {"stream", "samples"}  # SeededStream's state: the stream's own, and the samples this worker has read


def _as_is(sample: Any) -> Any:
    return sample  # the product's loader collates (the recipe's collate_fn), in the training process


class SeededStream(torch.utils.data.IterableDataset):
    """``stream`` as each loader worker reads it: before each of its samples, and before each pass starts, the
    worker's generators are seeded from (``seed``, the worker, the samples this worker has read); its state is the
    stream's and that count. ``seed`` is the run's seed and the rank (``prepare_stream``)."""

    def __init__(self, stream: Any, seed: int):
        self.stream, self.seed, self.samples = stream, seed, 0

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else -1
        seed_generators(self.seed, worker, self.samples, 0)  # what the stream draws as its pass starts
        samples = iter(self.stream)
        while True:
            seed_generators(self.seed, worker, self.samples, 1)  # what it draws to make its next sample
            try:
                sample = next(samples)
            except StopIteration:
                return
            self.samples += 1
            yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.samples = state["samples"]


def worker_loader(stream: Any, num_workers: int, seed: int, samples_per_step: int) -> Any:
    """A ``StatefulDataLoader`` over ``stream`` whose persistent workers yield one sample at a time, each with its
    worker's state; about a step's samples are in flight (at most ``MAX_PREFETCH`` a worker). Workers start at its
    first iteration."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ConfigError(
            f"num_workers={num_workers}: a stateful {type(stream).__name__} is read by worker processes through "
            f"torchdata's StatefulDataLoader, which is not installed; pip install 'resumable-train[streams]', or set "
            f"num_workers=0"
        ) from None
    remove_orphaned_semaphores_once()  # what earlier SIGKILLed process groups' loaders left in /dev/shm
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch: not the user's to fix
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            SeededStream(stream, seed),
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_as_is,
            persistent_workers=True,  # a new pass of the stream starts no worker
            multiprocessing_context="forkserver",  # as the product's own loader: forked Prefect threads die at exit
            prefetch_factor=min(MAX_PREFETCH, max(2, -(-samples_per_step // num_workers))),
            snapshot_every_n_steps=1,  # every sample carries its worker's state: exact after any sample
            generator=torch.Generator().manual_seed(seed % 2**63),  # the base seed (SeededStream reseeds per sample)
            worker_init_fn=functools.partial(die_with, os.getpid()),  # a forkserver's child: see lifetimes.py
        )


def check_loader_state(state: Any, num_workers: int, where: str) -> dict[str, Any]:
    """``state`` if it is a ``StatefulDataLoader`` state of ``num_workers`` workers as ``worker_loader`` writes it
    (no samples to replay, every worker's snapshot, plain values), else one DataError naming ``where``."""
    try:
        _check_shape(state, num_workers)
        _check_plain(state)
    except ValueError as exc:
        raise DataError(
            f"{where}: this rank's stream state (rng-rank<r>.pt, key 'data') is not the state of a StatefulDataLoader "
            f"with num_workers={num_workers}: {exc}; resume from another checkpoint (delete this one) or start a new "
            f"run_name"
        ) from None
    return state


def _check_shape(state: Any, num_workers: int) -> None:
    top = _keys(state, _TOP, "the state")
    if top["_steps_since_snapshot"] != 0 or type(top["_iterator_finished"]) is not bool:
        raise ValueError("it has samples to replay, or no end flag")  # each sample is a snapshot: none to replay
    snap = _keys(top["_snapshot"], _SNAPSHOT, "_snapshot")
    if not _is_int(snap["_snapshot_step"], 0, 2**62) or not _is_int(snap["_last_yielded_worker_id"], -1, num_workers):
        raise ValueError("its step or last worker is out of range")
    main = snap["_main_snapshot"]
    if not isinstance(main, dict) or main.get("_num_workers") != num_workers:
        raise ValueError(f"its main snapshot is not one of {num_workers} workers")
    workers = snap["_worker_snapshots"]
    expected = {f"worker_{i}" for i in range(num_workers)}
    if not isinstance(workers, dict) or set(workers) != expected:
        raise ValueError(f"its worker snapshots are not {sorted(expected)}")
    for i in range(num_workers):
        worker = _keys(workers[f"worker_{i}"], _WORKER, f"worker_{i}")
        if worker["worker_id"] != i or not isinstance(worker["fetcher_state"], dict):
            raise ValueError(f"worker_{i}'s snapshot names another worker, or has no fetcher state")
        seeded = _keys(worker["dataset_state"], _SEEDED, f"worker_{i}'s dataset state")
        if not _is_int(seeded["samples"], 0, 2**62):
            raise ValueError(f"worker_{i}'s sample count is not a count")


def _keys(value: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        found = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"{what} has {found}, not {sorted(keys)}")
    return value


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value < high


def _check_plain(state: Any) -> None:
    """Only dicts with string keys, lists, tuples, strings, numbers, booleans, None and tensors; bounded."""
    todo, seen = [(state, 0)], 0
    while todo:
        value, depth = todo.pop()
        seen += 1
        if seen > MAX_NODES or depth > MAX_DEPTH:
            raise ValueError(f"it holds more than {MAX_NODES} values or is nested deeper than {MAX_DEPTH}")
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise ValueError("a key is not a string")
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend((v, depth + 1) for v in value)
        elif not (value is None or isinstance(value, (str, int, float, bool, torch.Tensor))):
            raise ValueError(f"it holds a {type(value).__name__}")
