"""The run context a recipe sees: batch sizes, world, seed, precision and the length of the run.

Set as ``recipe.ctx`` right after the recipe is constructed, before ``train_dataset`` and the ``build_*``
calls, so a schedule can be built from ``ctx.total_steps`` instead of a step count copied into
``recipe_args`` by hand. ``total_*`` are counted at this launch's global batch size: after a batch-size
change the step counter continues at ``samples_seen // global_batch_size`` (see ``training.progress``),
and ``total_steps`` is the number of steps that ends the run at the new size.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from training.config import Duration, TrainConfig

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class RunContext:
    """What a recipe may know about the run it trains in. Read-only by convention."""

    run_name: str
    global_batch_size: int  # samples per optimizer step, summed over every process
    grad_accumulation: int  # micro-batches per process per optimizer step
    world_size: int
    rank: int
    local_rank: int
    seed: int
    device: torch.device
    precision: str  # "fp32", "bf16" or "fp16"
    grad_clip_norm: float | None
    parallelism: str  # "ddp" or "fsdp"
    max_duration: Duration
    save_interval: Duration
    eval_interval: Duration | None
    num_train_samples: int | None = None  # len(train_dataset()), known once the dataset is built

    @classmethod
    def of(cls, config: TrainConfig, *, rank: int = 0, world_size: int = 1, local_rank: int = 0,
           device: torch.device | None = None) -> RunContext:  # fmt: skip
        return cls(
            run_name=config.run_name,
            global_batch_size=config.global_batch_size,
            grad_accumulation=config.grad_accumulation,
            world_size=world_size,
            rank=rank,
            local_rank=local_rank,
            seed=config.seed,
            device=device or torch.device("cpu"),
            precision=config.precision,
            grad_clip_norm=config.grad_clip_norm,
            parallelism=config.parallelism,
            max_duration=config.duration,
            save_interval=config.interval,
            eval_interval=config.eval_every,
        )

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch one process loads: ceil(global / (world_size * grad_accumulation))."""
        return math.ceil(self.global_batch_size / (self.world_size * self.grad_accumulation))

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self._epoch_size() / self.global_batch_size)

    @property
    def total_samples(self) -> int:
        """Samples the whole run trains (``max_duration`` in samples)."""
        d = self.max_duration
        if d.unit == "sp":
            return d.value
        if d.unit == "ep":
            return d.value * self._epoch_size()
        return d.value * self.global_batch_size

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run at this global batch size (for LR schedules)."""
        d = self.max_duration
        if d.unit == "ba":
            return d.value
        if d.unit == "ep":
            return d.value * self.steps_per_epoch
        return math.ceil(d.value / self.global_batch_size)

    def _epoch_size(self) -> int:
        if self.num_train_samples is None:
            raise RuntimeError(
                "ctx.total_steps/total_samples/steps_per_epoch need the dataset's size: read them in build_model, "
                "build_optimizer or build_scheduler (after train_dataset()), not in the recipe's constructor"
            )
        return self.num_train_samples

    # -- precision --------------------------------------------------------------------------------
    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return DTYPES[self.precision]

    def autocast(self) -> Any:
        """The autocast context of ``precision`` on this device (a no-op for fp32)."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)
