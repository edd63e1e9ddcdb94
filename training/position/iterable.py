"""A stateful ``IterableDataset`` (``state_dict()`` / ``load_state_dict()``): its position is its own state, saved per rank.

The product's position is a sample id for a map-style dataset (``training.position.sampler``). A stream has no ids:
each rank iterates its own iterable (the recipe shards it by ``ctx.rank`` / ``ctx.world_size``) and the state that the
iterable reports is the position. ``StatefulIterable`` makes it look map-style to the loop: every id the sampler asks
for is the stream's next sample, in order, so the product's DataLoader takes micro-batches in the stream's order and
``samples_seen`` still counts. Each rank's state goes beside its RNG state (``rng-rank<r>.pt``, under the one
manifest) in every checkpoint and snapshot, with the topology it was taken at.

With ``num_workers > 0`` the stream is read by torchdata's ``StatefulDataLoader`` (one sample at a time, every sample
carrying its worker's state), whose ``state_dict()`` (every worker's stream state, and which worker yields next) is
the saved position: the product's own loader then reads the stream in the training process (``loader_workers``). The
saved state comes from the store: it is loaded with ``weights_only=True`` and its shape checked before use.

The state resumes the stream exactly only at the same world size, global batch size and ``num_workers`` (as
torchdata's and Hugging Face's own): a resume at another is refused before training, in one line naming
``training.data.ShardedDataset``, whose sample ids survive any change.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from training.config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)
STREAM_EPOCH = 2**31 - 1  # the epoch size of a stream without len() (the most an epoch may have): durations in sp/ba
SHARDED_FIX = (
    "to change it, train from training.data.ShardedDataset(url, format) over the same files (tokens, jsonl or "
    "parquet), whose position survives world size, batch size and worker changes"
)


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class _Ids:
    """Ids 0..n-1 in order without holding them (a stream's epoch may be 2**31 long): what the sampler slices."""

    def __init__(self, ids: range):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: Any) -> Any:
        return _Ids(self.ids[k]) if isinstance(k, slice) else self.ids[k]

    def tolist(self) -> list[int]:
        return list(self.ids)


class StatefulIterable:
    """The recipe's stateful iterable as the loop sees it: ``len()`` is its own (else ``STREAM_EPOCH``), and whatever
    ids are asked for, the next samples of the stream come back, in order. A stream that ends starts its next pass.
    ``read_with_workers`` puts a ``StatefulDataLoader`` between the two: the samples then come from its workers."""

    def __init__(self, stream: Any):
        self.stream = stream
        self._it: Any = None
        self.num_samples = len(stream) if hasattr(stream, "__len__") else STREAM_EPOCH
        self.workers: Any = None  # with num_workers > 0: the StatefulDataLoader whose workers read the stream
        self._workers_started = False

    def __len__(self) -> int:
        return self.num_samples

    def read_with_workers(self, num_workers: int, seed: int, samples_per_step: int) -> None:
        """From now on the stream is read by ``num_workers`` worker processes (started at the first read)."""
        from training.position.stream_workers import worker_loader

        self.workers = worker_loader(self.stream, num_workers, seed, samples_per_step)
        self._it, self._workers_started = None, False

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> _Ids:
        return _Ids(range(self.num_samples))  # the stream's own order: shuffling is the stream's business

    def _next(self) -> Any:
        if self.workers is not None and not self._workers_started:
            return self._start_workers()
        source = self.stream if self.workers is None else self.workers
        for _ in range(2):
            if self._it is None:
                self._it = iter(source)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None  # the next pass
        raise ConfigError(f"train_dataset() returned {type(self.stream).__name__}, a stream that yields no sample")

    def _start_workers(self) -> Any:
        """The first read with workers starts them (from the loaded state, on a resume): one line says how long they
        took until their first sample."""
        t0, self._workers_started = time.perf_counter(), True
        self._it = iter(self.workers)
        first = self._next()
        logger.info(
            "stream workers started (num_workers=%d) in %.2f s, their first sample included",
            self.workers.num_workers,
            time.perf_counter() - t0,
        )
        return first

    def __getitem__(self, i: int) -> Any:
        return self._next()

    def __getitems__(self, ids: list[int]) -> list[Any]:
        return [self._next() for _ in ids]

    def capture(self, world_size: int, global_batch_size: int, num_workers: int) -> dict[str, Any]:
        """This rank's entry of a checkpoint: the stream's state (with workers: the loader's, every worker's stream
        state in it) and the topology it resumes exactly at."""
        source = self.stream if self.workers is None else self.workers
        return {
            "state": source.state_dict(),
            "world_size": world_size,
            "global_batch_size": global_batch_size,
            "num_workers": num_workers,
        }

    def restore(self, saved: Any, world_size: int, global_batch_size: int, num_workers: int, where: str) -> None:
        """Loads this rank's saved state; another topology (or no state for this rank) is one ConfigError, a loader
        state of another shape one DataError."""
        now = {"world_size": world_size, "global_batch_size": global_batch_size, "num_workers": num_workers}
        if not isinstance(saved, dict) or "state" not in saved:
            raise ConfigError(
                f"{where} has no stream state for this rank (world_size={world_size}): a stateful "
                f"{type(self.stream).__name__} resumes exactly only where it was saved; {SHARDED_FIX}"
            )
        changed = [f"{k}={saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: {where} saved the position of a stateful {type(self.stream).__name__}, which "
                f"resumes exactly only at the topology it was saved at; run with the saved values, or {SHARDED_FIX}"
            )
        if self.workers is None:
            self.stream.load_state_dict(saved["state"])
        else:
            from training.position.stream_workers import check_loader_state

            self.workers.load_state_dict(check_loader_state(saved["state"], num_workers, where))
            self._workers_started = False  # they start again, from the loaded state
        self._it = None  # the next sample comes from the loaded state


def loader_workers(dataset: Any, num_workers: int) -> int:
    """The worker processes of the product's own DataLoader: none for a stateful stream, whose workers (if any) are
    its ``StatefulDataLoader``'s, so that the position is one state, taken in the training process."""
    return 0 if isinstance(dataset, StatefulIterable) else num_workers


def prepare_stream(dataset: Any, config: TrainConfig, rank: int, world_size: int) -> None:
    """What a stateful stream cannot do, refused before training in one line; with ``num_workers > 0``, the workers
    that read it. Another dataset: nothing to do."""
    if not isinstance(dataset, StatefulIterable):
        return
    if config.parallelism == "fsdp":
        raise ConfigError(
            f"parallelism='fsdp': a stateful {type(dataset.stream).__name__}'s position is saved with parallelism='ddp' "
            f"only; use ddp, or {SHARDED_FIX}"
        )
    if config.num_workers:
        per_step = -(-config.global_batch_size // world_size)
        dataset.read_with_workers(config.num_workers, config.seed * 1_000_003 + rank, per_step)
