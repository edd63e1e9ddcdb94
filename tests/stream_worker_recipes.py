"""A stateful stream that its loader workers share (training/position/stream_workers.py): ``CountingStream`` whose
worker ``w`` of ``n`` draws samples ``w, w+n, w+2n, ...`` of the rank's sequence, as torch's IterableDataset contract
asks (``get_worker_info()``); its state is the worker's own count. Each sample is augmented with noise drawn from the
worker's own generators (torch's, Python's ``random``, NumPy's global one), which its state does not hold."""

from __future__ import annotations

import torch

from tests.stateful_iterable_recipes import CountingStream, CountingStreamRecipe, augment


class WorkerCountingStream(CountingStream):
    """Sample n of rank r is drawn from a generator seeded (seed, r, n) whichever worker draws it, then augmented."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            n = self.count * workers + worker
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + n)
            x = torch.randn(self.in_features, generator=g)
            self.count += 1
            yield {"x": augment(x), "y": (x @ self.teacher).argmax()}


class WorkerCountingStreamRecipe(CountingStreamRecipe):
    """The synthetic task, fed by one ``WorkerCountingStream`` per rank."""

    def train_dataset(self):
        return WorkerCountingStream(self.data_seed, self.ctx.rank, self.in_features, self.num_classes)
