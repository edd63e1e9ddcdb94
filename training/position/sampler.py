"""The sample order: one seeded permutation per epoch, independent of batch size and world size.

A global batch is the next ``global_batch_size`` ids of that order starting at ``sample_in_epoch``;
rank ``r`` of ``world_size`` takes ids ``r, r + world_size, ...`` of it. Seeking to any position is
slicing, O(1) in the position: no batch is replayed to get there.

Public: a loop of your own (``train_loop``) can use it to resume its DataLoader exactly::

    sampler = ResumableBatchSampler(len(dataset), 64, seed=0, epoch=state["epoch"], start=state["sample_in_epoch"])
    loader = DataLoader(dataset, batch_sampler=sampler)

A dataset with an ``epoch_order(seed, epoch, shuffle)`` method (streaming shards: training/data/) passes it as
``order``: the sampler then visits the dataset's own order, which must be a permutation of the ids.

With ``micro_batches=k`` every rank's share of a step is loaded as ``k`` separate micro-batches
(gradient accumulation): the DataLoader yields ``k`` batches per step, and ``steps()`` says which ids
each one holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Sampler

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, epoch) over the seed space


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits sample ids 0..num_samples-1."""
    if not shuffle:
        return torch.arange(num_samples)
    g = torch.Generator().manual_seed((seed * _MIX + epoch) % (2**63 - 1))
    return torch.randperm(num_samples, generator=g)


class ResumableBatchSampler(Sampler[list[int]]):
    """This rank's share of each global batch, from ``start`` (a sample position) to ``stop`` (default: the
    epoch's end; a duration in samples may end mid-epoch, and then the last batch is cut to fit).

    Public: the product's own units use it, and a ``train_loop`` of your own can too, to resume its DataLoader at
    the exact sample. Each epoch's order depends only on ``seed`` and ``epoch``, so saving ``epoch`` and the
    position in it (``sample_in_epoch``) with the model is enough to continue where a report left off::

        from torch.utils.data import DataLoader
        from training import ResumableBatchSampler

        sampler = ResumableBatchSampler(len(dataset), ctx.global_batch_size, seed=ctx.seed, epoch=epoch,
                                        start=sample_in_epoch)  # 0 in a fresh epoch; the saved value on resume
        loader = DataLoader(dataset, batch_sampler=sampler, generator=torch.Generator().manual_seed(epoch))
        for batch in loader:
            ...                                  # one optimizer step
            sample_in_epoch += len(batch[0])     # samples this batch held; at len(dataset) the epoch ends
            ctx.report(metrics, state={..., "epoch": epoch, "sample_in_epoch": sample_in_epoch})

    Give the DataLoader a generator of its own, as above: without one, starting each loader's iteration draws
    from torch's global RNG, and a resumed run's random numbers (dropout, augmentation) would differ from an
    uninterrupted run's. With ``world_size > 1`` each rank yields its share of every global batch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        seed: int,
        epoch: int,
        start: int = 0,
        stop: int | None = None,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        micro_batches: int = 1,
        order: Callable[[int, int, bool], Any] | None = None,
    ):
        stop = num_samples if stop is None else stop
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches}: use 1 or more")
        if not 0 <= start <= stop <= num_samples:
            raise ValueError(f"start={start}, stop={stop}: outside an epoch of {num_samples} samples")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.epoch, self.start, self.stop, self.shuffle = seed, epoch, start, stop, shuffle
        self.rank, self.world_size, self.micro_batches = rank, world_size, micro_batches
        self._order_of = order
        self._order: Any = None

    @property
    def order(self) -> Any:
        """The epoch's order, built once (O(n)): ``shares`` and the DataLoader's ``__iter__`` both walk it. A
        dataset's own ``epoch_order(seed, epoch, shuffle)`` (``order``: streaming shards, training/data/) is used
        instead: sliced a window at a time, it costs the windows a position touches, not the epoch before it."""
        if self._order is None:
            if self._order_of is not None:
                self._order = self._order_of(self.seed, self.epoch, self.shuffle)
                if len(self._order) != self.num_samples:
                    raise ValueError(f"the dataset's epoch_order has {len(self._order)} ids for {self.num_samples}")
            else:
                self._order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        return self._order

    def shares(self):
        """(this rank's sample ids, size of the global batch) per step. A rank's share is empty when the
        epoch's short last batch has fewer samples than there are ranks."""
        order = self.order
        for begin in range(self.start, self.stop, self.global_batch_size):
            batch = order[begin : min(begin + self.global_batch_size, self.stop)]
            yield batch[self.rank :: self.world_size].tolist(), len(batch)

    def steps(self):
        """(this rank's micro-batches: ``micro_batches`` lists of sample ids, size of the global batch) per
        step. The share is cut into nearly equal consecutive pieces; a piece may be empty."""
        k = self.micro_batches
        for ids, global_n in self.shares():
            yield [ids[j * len(ids) // k : (j + 1) * len(ids) // k] for j in range(k)], global_n

    def __iter__(self):
        """What the DataLoader loads: every micro-batch of every step. An empty one loads one sample of the
        epoch for a zero-weight pass, so that every rank takes part in every gradient all-reduce."""
        for micro, _ in self.steps():
            for ids in micro:
                yield ids if ids else [int(self.order[self.num_samples - 1])]

    def __len__(self) -> int:
        return math.ceil((self.stop - self.start) / self.global_batch_size) * self.micro_batches
