"""A unit's running figures, one typed value: what the loop sums step by step and what a checkpoint inside a unit records.

A unit resumed from a checkpoint inside it (a snapshot, a stop) carries the figures of the steps before it, so it
reports what an uninterrupted unit reports (training/unit/loop.py). ``UnitFigures`` is the part that travels in the
manifest (``record`` / ``from_record``: the manifest is untrusted input, read back typed or not at all);
``AttemptFigures`` is this attempt's own (its steps, its speed, its snapshot stalls), never recorded.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

UNIT_SO_FAR = "unit_so_far"  # manifest metadata: a checkpoint inside a unit records the unit's figures so far
_NUMBERS = ("loss_sum", "loss_count", "norm_sum", "norm_count", "unit_start_samples", "snapshots")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class UnitFigures:
    """Running sums from the unit's start (a resumed unit's start included)."""

    unit_start_samples: int
    loss_sum: float = 0.0
    loss_count: int = 0
    norm_sum: float = 0.0
    norm_count: int = 0
    snapshots: int = 0
    evaluated: dict[str, float] = field(default_factory=dict)  # the newest evaluation's metrics, ``eval_``-prefixed

    def add_step(self, loss: float, grad_norm: float | None) -> None:
        self.loss_sum, self.loss_count = self.loss_sum + loss, self.loss_count + 1
        if grad_norm is not None:
            self.norm_sum, self.norm_count = self.norm_sum + grad_norm, self.norm_count + 1

    @property
    def train_loss(self) -> float:
        return self.loss_sum / max(self.loss_count, 1)

    def copy(self) -> UnitFigures:
        """A copy that later steps do not change (what a checkpoint taken now records)."""
        return dataclasses.replace(self, evaluated=dict(self.evaluated))

    def record(self) -> dict[str, Any]:
        """What a manifest records (``UNIT_SO_FAR``)."""
        return {**{k: getattr(self, k) for k in _NUMBERS}, "evaluated": dict(self.evaluated)}

    @classmethod
    def from_record(cls, recorded: Any) -> UnitFigures | None:
        """A manifest's record, typed, or None when there is none or it does not read as one (the unit's figures then
        cover the resumed steps only, as before)."""
        if not isinstance(recorded, dict):
            return None
        numbers: dict[str, Any] = {k: recorded.get(k) for k in _NUMBERS}
        if not all(_number(v) for v in numbers.values()):
            return None
        evaluated = recorded.get("evaluated") or {}
        if not isinstance(evaluated, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in evaluated.items()
        ):
            return None
        return cls(
            unit_start_samples=int(numbers["unit_start_samples"]),
            loss_sum=float(numbers["loss_sum"]),
            loss_count=int(numbers["loss_count"]),
            norm_sum=float(numbers["norm_sum"]),
            norm_count=int(numbers["norm_count"]),
            snapshots=int(numbers["snapshots"]),
            evaluated={k: float(v) for k, v in evaluated.items()},
        )


@dataclass
class AttemptFigures:
    """This attempt's own figures: its steps, its speed (samples since it started), its snapshots' stalls."""

    start_samples: int
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    last_loss: float = 0.0
    stalls: list[float] = field(default_factory=list)

    def step(self, loss: float) -> None:
        self.steps, self.last_loss = self.steps + 1, loss

    def rate(self, samples_seen: int) -> float:
        """Samples per second trained by this attempt so far."""
        return (samples_seen - self.start_samples) / max(time.perf_counter() - self.started, 1e-9)

    def metrics(self, unit: UnitFigures, samples_seen: int) -> dict[str, float]:
        """The unit's metrics: loss, samples and evaluation over the whole unit, speed over this attempt."""
        seconds = time.perf_counter() - self.started
        return {
            "train_loss": unit.train_loss,
            "samples": float(samples_seen - unit.unit_start_samples),  # the whole unit's, a resumed one's too
            "train_seconds": seconds,
            "samples_per_second": (samples_seen - self.start_samples) / max(seconds, 1e-9),
            **({"grad_norm": unit.norm_sum / unit.norm_count} if unit.norm_count else {}),
            **({"snapshots": float(unit.snapshots)} if unit.snapshots else {}),
            **({"snapshot_seconds_max": max(self.stalls)} if self.stalls else {}),
            **unit.evaluated,
        }
