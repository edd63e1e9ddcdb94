"""The baseline: the same training written as a plain PyTorch loop, with no Prefect and no checkpoints.

Same recipe, same seeding order as the product's fresh start (``training.unit.session.restore``), same sample
order (``ResumableBatchSampler``, one seeded permutation per epoch) and the same optimizer and scheduler
steps, so its per-unit mean losses equal the flow's: a check that both train the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.utils.data import DataLoader

from recipes.synthetic import SyntheticRecipe
from training.position.sampler import ResumableBatchSampler
from training.unit import rng


@dataclass
class PlainRun:
    build_seconds: float
    unit_seconds: list[float] = field(default_factory=list)
    unit_cpu: list[float] = field(default_factory=list)  # this process's CPU seconds (all its threads)
    unit_losses: list[float] = field(default_factory=list)
    cpu_where: dict[str, float] = field(default_factory=dict)  # filled by a caller that watches the CPU
    model: torch.nn.Module | None = None  # the trained model, for a caller that evaluates it


def train_plain(recipe_args: dict, batch_size: int, seed: int, num_units: int, steps_per_unit: int) -> PlainRun:
    """Trains ``num_units`` x ``steps_per_unit`` steps; times the build and every unit."""
    t0 = time.perf_counter()
    recipe = SyntheticRecipe(**recipe_args)
    data = recipe.train_dataset()
    rng.seed_all(seed)
    model = recipe.build_model()
    optimizer = recipe.build_optimizer(model)
    scheduler = recipe.build_scheduler(optimizer)
    model.train()
    run = PlainRun(build_seconds=time.perf_counter() - t0)
    epoch, losses, t_unit, cpu_unit = 0, [], time.perf_counter(), time.process_time()
    while len(run.unit_seconds) < num_units:
        sampler = ResumableBatchSampler(len(cast(Sized, data)), batch_size, seed=seed, epoch=epoch)
        # A generator of its own, as the product passes: else the loader draws its seed from the global RNG.
        for batch in DataLoader(data, batch_sampler=sampler, generator=torch.Generator().manual_seed(epoch)):
            optimizer.zero_grad(set_to_none=True)
            loss = recipe.loss(model, batch)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            if len(losses) == steps_per_unit:
                run.unit_seconds.append(time.perf_counter() - t_unit)
                run.unit_cpu.append(time.process_time() - cpu_unit)
                run.unit_losses.append(sum(losses) / len(losses))
                losses, t_unit, cpu_unit = [], time.perf_counter(), time.process_time()
                if len(run.unit_seconds) == num_units:
                    break
        epoch += 1
    run.model = model
    return run


def seconds_per_step(recipe_args: dict, batch_size: int, steps: int = 3) -> float:
    """A quick measure of one training step (after one warm-up step), to size units in seconds."""
    recipe = SyntheticRecipe(**recipe_args)
    data = recipe.train_dataset()
    model = recipe.build_model()
    optimizer = recipe.build_optimizer(model)
    sampler = ResumableBatchSampler(len(cast(Sized, data)), batch_size, seed=0, epoch=0)
    batches = iter(DataLoader(data, batch_sampler=sampler))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        recipe.loss(model, next(batches)).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    del model, optimizer
    return sorted(times[1:])[len(times[1:]) // 2]


def parameter_bytes(recipe_args: dict) -> int:
    with torch.device("meta"):
        model = SyntheticRecipe(**recipe_args).build_model()
    return sum(p.numel() * p.element_size() for p in model.parameters())
