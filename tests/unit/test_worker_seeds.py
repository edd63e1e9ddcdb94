"""A map-style dataset read by loader workers (num_workers > 0, training/unit/loop.py) that draws random numbers while
it loads (augmentation) from the worker's own generators: before each batch the worker's torch, Python ``random`` and
NumPy generators are seeded from the run's seed, the epoch and the batch's ids (training/position/worker_seeds.py).
Real workers (the product's loader classes over a real DataLoader): a new worker started where a run resumes draws
what an uninterrupted run's worker drew there, and another epoch's batch of the same ids draws other numbers. The
stream side (a stateful stream's workers, seeded per sample) is tests/unit/test_stream_workers.py's and
tests/integration/test_stateful_iterable_kill.py's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from training.position.sampler import ResumableBatchSampler
from training.unit.loop import _CurrentSampler, _SeededByBatch

N, BATCH, SEED = 24, 4, 7


class Noisy(Dataset):
    """Sample i is (i, a draw of torch's, of Python's ``random``, of NumPy's global generator)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [float(i), float(torch.rand(())), random.random(), float(np.random.rand())], dtype=torch.float64
        )


def load(current: _CurrentSampler, loader: DataLoader, epoch: int, start: int = 0) -> list[torch.Tensor]:
    """Epoch ``epoch`` from sample ``start``, in id order, as the product's loop swaps its loader's batch sampler."""
    current.current = ResumableBatchSampler(N, BATCH, seed=SEED, epoch=epoch, start=start, shuffle=False)
    return list(loader)


@pytest.fixture(scope="module")
def loaded():
    """Two epochs through one worker that outlives them (the product's loader for a map-style dataset), then epoch 1
    again from its fourth batch through a new worker, as a resumed run's."""
    current, dataset = _CurrentSampler(), _SeededByBatch(Noisy(), SEED)
    common = dict(batch_sampler=current, num_workers=1, multiprocessing_context="forkserver")
    uninterrupted = DataLoader(dataset, persistent_workers=True, **common)
    first, second = load(current, uninterrupted, 0), load(current, uninterrupted, 1)
    resumed = load(current, DataLoader(dataset, **common), 1, 3 * BATCH)
    del uninterrupted  # its worker ends
    return first, second, resumed


@pytest.mark.slow  # two loader worker processes start (~6 s each at load 7)
def test_a_new_worker_where_a_run_resumes_draws_what_the_uninterrupted_runs_worker_drew(loaded):
    _, second, resumed = loaded
    assert len(resumed) == len(second) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, second[3:], strict=True))
    draws = torch.cat(second)[:, 1:]
    assert len(set(draws.flatten().tolist())) == draws.numel()  # each sample drew numbers of its own


@pytest.mark.slow  # two loader worker processes start (~6 s each at load 7)
def test_the_same_ids_in_another_epoch_draw_other_numbers(loaded):
    first, second, _ = loaded
    assert all(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(first, second, strict=True))  # the same ids, in order
    assert all(bool((a[:, 1:] != b[:, 1:]).all()) for a, b in zip(first, second, strict=True))  # every draw differs
