"""Skip cost: time to the first batch after seeking to sample 0, 1e3, 1e6, 1e7 of a 2e7-sample epoch.

Seeking is slicing the epoch's order, so it should not grow with the position. Building the order (a
seeded permutation of the epoch) is O(n) and paid at any position, including 0: it is timed alone too,
so that what the seek itself adds is visible.
"""

from __future__ import annotations

import time

from torch.utils.data import DataLoader, Dataset

from bench.common import load_average, median, parser, record, rotated
from training.position.sampler import ResumableBatchSampler, epoch_order

POSITIONS = [0, 1_000, 1_000_000, 10_000_000]


def _first_batch(epoch_size: int, start: int, batch: int) -> float:
    t0 = time.perf_counter()
    next(iter(ResumableBatchSampler(epoch_size, batch, seed=1, epoch=3, start=start)))
    return time.perf_counter() - t0


def _unit_loop_first_batch(epoch_size: int, start: int, batch: int) -> float:
    """The first batch as a unit of training/unit/loop.py takes it: ``zip(sampler.shares(), loader)``, where the
    loader iterates the same sampler (so the epoch's order is built twice)."""
    sampler = ResumableBatchSampler(epoch_size, batch, seed=1, epoch=3, start=start)
    t0 = time.perf_counter()
    next(iter(zip(sampler.shares(), DataLoader(_Ids(), batch_sampler=sampler), strict=False)))
    return time.perf_counter() - t0


class _Ids(Dataset[int]):
    """A dataset whose sample i is i: loading costs nothing, only the order is measured."""

    def __getitem__(self, i: int) -> int:
        return i


def _order_alone(epoch_size: int) -> float:
    t0 = time.perf_counter()
    epoch_order(epoch_size, seed=1, epoch=3)
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    p = parser("skip", "Skip cost of ResumableBatchSampler: time to the first batch after a seek.")
    p.add_argument("--epoch-size", type=int, default=20_000_000, help="samples in the epoch")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--reps", type=int, default=5, help="repetitions (alternating positions), median reported")
    a = p.parse_args(argv)
    load = load_average()
    positions = [p for p in POSITIONS if p < a.epoch_size]
    mid = positions[-1]
    variants = [("order", None), ("unit loop", mid)] + [("seek", pos) for pos in positions]
    times: dict = {v: [] for v in variants}
    for rep in range(a.reps):
        for v in rotated(variants, rep):
            if v[0] == "order":
                times[v].append(_order_alone(a.epoch_size))
            elif v[0] == "unit loop":
                times[v].append(_unit_loop_first_batch(a.epoch_size, v[1], a.batch))
            else:
                times[v].append(_first_batch(a.epoch_size, v[1], a.batch))
    base, order = median(times[("seek", 0)]), median(times[("order", None)])
    lines = [
        f"Epoch of {a.epoch_size:,} samples, batch {a.batch}; {a.reps} alternating repetitions, medians.",
        "",
        "| seek to sample | time to first batch | vs sample 0 | minus building the order |",
        "| --- | --- | --- | --- |",
    ]
    for pos in positions:
        m = median(times[("seek", pos)])
        lines.append(f"| {pos:,} | {m * 1000:.0f} ms | {m / base:.2f}x | {(m - order) * 1000:+.1f} ms |")
    lines += [
        "",
        f"Building the epoch's order alone (`epoch_order`, a seeded `torch.randperm` of the epoch): "
        f"{order * 1000:.0f} ms, paid at every position including 0 (O(n) in the epoch). The seek "
        "itself is a slice: O(1) in the position.",
        "",
        f"The first batch as a unit of `training/unit/loop.py` takes it (`zip(sampler.shares(), loader)`, the "
        f"loader iterating the same sampler), seeking to sample {mid:,}: "
        f"{median(times[('unit loop', mid)]) * 1000:.0f} ms = "
        f"{median(times[('unit loop', mid)]) / order:.1f}x building the order: it is built by both "
        "iterators, and again by every unit (each unit makes a new sampler).",
    ]
    record(f"Skip cost (goal: flat in the position) — epoch of {a.epoch_size:,} samples", lines, load)
