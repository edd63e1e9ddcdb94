"""A stateful ``IterableDataset`` (``state_dict()`` / ``load_state_dict()``): its position is its own state, saved per rank.

The product's position is a sample id for a map-style dataset (``training.position.sampler``). A stream has no ids:
each rank iterates its own iterable (the recipe shards it by ``ctx.rank`` / ``ctx.world_size``) and the state that the
iterable reports is the position. ``StatefulIterable`` makes it look map-style to the loop: every id the sampler asks
for is the stream's next sample, in order, so the product's DataLoader takes micro-batches in the stream's order and
``samples_seen`` still counts. Each rank's ``state_dict()`` goes beside its RNG state (``rng-rank<r>.pt``, under the one
manifest) in every checkpoint and snapshot, with the topology it was taken at.

The state resumes the stream exactly only at the same world size, global batch size and ``num_workers`` (as
torchdata's and Hugging Face's own): a resume at another is refused before training, in one line naming
``training.data.ShardedDataset``, whose sample ids survive any change. ``num_workers > 0`` is refused: torch's
DataLoader cannot capture its worker iterators' states.
"""

from __future__ import annotations

from typing import Any

from training.config import ConfigError

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
    ids are asked for, the next samples of the stream come back, in order. A stream that ends starts its next pass."""

    def __init__(self, stream: Any):
        self.stream = stream
        self._it: Any = None
        self.num_samples = len(stream) if hasattr(stream, "__len__") else STREAM_EPOCH

    def __len__(self) -> int:
        return self.num_samples

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> _Ids:
        return _Ids(range(self.num_samples))  # the stream's own order: shuffling is the stream's business

    def _next(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.stream)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None  # the next pass
        raise ConfigError(f"train_dataset() returned {type(self.stream).__name__}, a stream that yields no sample")

    def __getitem__(self, i: int) -> Any:
        return self._next()

    def __getitems__(self, ids: list[int]) -> list[Any]:
        return [self._next() for _ in ids]

    def capture(self, world_size: int, global_batch_size: int, num_workers: int) -> dict[str, Any]:
        """This rank's entry of a checkpoint: the stream's state and the topology it resumes exactly at."""
        return {
            "state": self.stream.state_dict(),
            "world_size": world_size,
            "global_batch_size": global_batch_size,
            "num_workers": num_workers,
        }

    def restore(self, saved: Any, world_size: int, global_batch_size: int, num_workers: int, where: str) -> None:
        """Loads this rank's saved state; another topology (or no state for this rank) is one ConfigError."""
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
        self.stream.load_state_dict(saved["state"])
        self._it = None  # the next sample comes from the loaded state


def check_options(dataset: Any, num_workers: int, parallelism: str) -> None:
    """What a stateful stream cannot do, refused before training in one line each."""
    if isinstance(dataset, StatefulIterable) and parallelism == "fsdp":
        raise ConfigError(
            f"parallelism='fsdp': a stateful {type(dataset.stream).__name__}'s position is saved with parallelism='ddp' "
            f"only; use ddp, or {SHARDED_FIX}"
        )
    if isinstance(dataset, StatefulIterable) and num_workers:
        raise ConfigError(
            f"num_workers={num_workers}: a stateful {type(dataset.stream).__name__} is read in the training process "
            f"(torch's DataLoader cannot capture its worker iterators' states); set num_workers=0, or {SHARDED_FIX}"
        )
