"""An epoch's sample order over a folder of shards that needs no state to survive a resume: the shards are shuffled
from (seed, epoch), then the samples within each window of ``window`` consecutive shards of that order, so a position
in it is found by arithmetic, never by reading what came before (a resume at 90 % of an epoch starts as fast as one at
10 %), and a window's shards are the only ones being read at a time (what the cache holds). Apart from the dataset
because it reads no data: only the shards' sample counts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

_MIX = 0x5AD_5EED  # keeps the data order's stream apart from any other seeded by the same (seed, epoch)


class WindowedOrder:
    """An epoch's sample order, computed a window at a time: ``order[a:b]`` and ``order[i]`` cost the windows they
    touch, never the epoch before them. Shards are permuted from (seed, epoch); each window of ``window`` consecutive
    shards of that permutation has its samples permuted from (seed, epoch, window number)."""

    def __init__(self, counts: Sequence[int], seed: int, epoch: int, window: int, shuffle: bool = True):
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        n = len(counts)
        starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        perm = self._rng(-1).permutation(n) if shuffle else np.arange(n)
        self.groups = [perm[w : w + window] for w in range(0, n, window)]
        self.starts, self.counts = starts, np.asarray(counts, dtype=np.int64)
        sizes = [int(self.counts[g].sum()) for g in self.groups]
        self.window_starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.on_window: Callable[[WindowedOrder, int], None] | None = None  # told when a window is first computed

    def _rng(self, window: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([_MIX, self.seed & (2**63 - 1), self.epoch, window + 1]))

    def __len__(self) -> int:
        return int(self.window_starts[-1])

    def window(self, w: int) -> np.ndarray:
        ids = self._cache.get(w)
        if ids is None:
            parts = [np.arange(self.starts[s], self.starts[s] + self.counts[s]) for s in self.groups[w]]
            ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
            if self.shuffle:
                ids = ids[self._rng(w).permutation(len(ids))]
            self._cache[w] = ids
            if self.on_window is not None:
                self.on_window(self, w)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return ids

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("an epoch order is sliced in order only")
            parts = []
            while start < stop:
                w = int(np.searchsorted(self.window_starts, start, side="right")) - 1
                begin, end = int(self.window_starts[w]), int(self.window_starts[w + 1])
                parts.append(self.window(w)[start - begin : min(stop, end) - begin])
                start = min(stop, end)
            return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, np.int64))
        i = int(key) + (len(self) if key < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(key)
        w = int(np.searchsorted(self.window_starts, i, side="right")) - 1
        return torch.tensor(int(self.window(w)[i - int(self.window_starts[w])]))
