"""Skip cost: time to the first batch after seeking to sample 0, 1e3, 1e6, 1e7 of a 2e7-sample epoch.

Seeking is slicing the epoch's order, so it should not grow with the position. (Building the order,
a permutation of the epoch, is O(n) and paid at any position, including 0.)
"""

from __future__ import annotations

import time

from bench.common import command_line, median, record
from training.sampler import ResumableBatchSampler


def run(epoch_size: int = 20_000_000, reps: int = 5) -> None:
    positions = [0, 1_000, 1_000_000, 10_000_000]
    times: dict[int, list[float]] = {p: [] for p in positions}
    for _ in range(reps):
        for p in positions:  # alternating positions within each repetition
            t0 = time.perf_counter()
            next(iter(ResumableBatchSampler(epoch_size, 256, seed=1, epoch=3, start=p)))
            times[p].append(time.perf_counter() - t0)
    base = median(times[0])
    lines = ["| seek to sample | time to first batch (median of %d) | vs sample 0 |" % reps, "| --- | --- | --- |"]
    lines += [f"| {p:,} | {median(times[p]) * 1000:.0f} ms | {median(times[p]) / base:.2f}x |" for p in positions]
    record(f"Skip cost (epoch of {epoch_size:,} samples)", command_line(), lines)
