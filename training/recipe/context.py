"""The run context a recipe sees: batch sizes, world, seed, precision and the length of the run.

Set as ``recipe.ctx`` right after the recipe is constructed, before ``train_dataset`` and the ``build_*``
calls, so a schedule can be built from ``ctx.total_steps`` instead of a step count copied into
``recipe_args`` by hand. ``total_*`` are counted at this launch's global batch size: after a batch-size
change the step counter continues at ``samples_seen // global_batch_size`` (see ``training.position.progress``),
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
    # Set by the loop for a recipe's own ``train_step(ctx, batch)``:
    model: torch.nn.Module | None = None  # what to call forward on (the DDP/FSDP-wrapped model)
    optimizer: Any = None  # the optimizer build_optimizer returned
    scaler: Any = None  # fp16's GradScaler, else None
    batch_weight: float = 1.0  # this batch's share of the global batch, times world_size (see backward)
    last_grad_norm: float | None = None  # the gradient norm before clipping, of the last step()
    samples_seen: int = 0  # the run's data position before this step: samples every rank took so far

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        device: torch.device | None = None,
    ) -> RunContext:
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
                "ctx.total_steps/total_samples/steps_per_epoch need the dataset's size: read them in build_optimizer "
                "or build_scheduler (after train_dataset()), not in the constructor or build_model"
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

    # -- the step, for a recipe's own train_step ------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` done right for this run: weighted by the batch's share of the global batch (so
        that averaging over processes gives the global batch's mean, even for a short last batch) and
        scaled for fp16. ``loss`` is the mean over this batch."""
        weighted = loss * self.batch_weight if self.batch_weight != 1.0 else loss
        (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()

    def step(self, *optimizers: Any) -> None:
        """Clips (``grad_clip_norm``, after unscaling fp16 gradients) and steps ``optimizers`` (default: the
        recipe's one), then updates the fp16 scaler. Zeroing gradients stays with the caller."""
        optimizers = optimizers or (self.optimizer,)
        if self.grad_clip_norm is not None:
            if self.scaler is not None:
                for optimizer in optimizers:
                    self.scaler.unscale_(optimizer)
            assert self.model is not None
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
            full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor of the global norm
            self.last_grad_norm = float(full() if full is not None else norm)
        for optimizer in optimizers:
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
