"""Evaluation of a committed checkpoint on the recipe's eval split (sample-weighted means)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from checkpointing.store import STATE_FILE
from training.config import TrainConfig
from training.metrics.log import metrics_for
from training.recipe.context import RunContext
from training.recipe.hooks import Hooks
from training.recipe.loader import load_recipe
from training.start.store import open_store
from training.unit import session as sessions
from training.unit.warm import PROCESS, SessionCache

logger = logging.getLogger(__name__)


def evaluate_checkpoint(config: TrainConfig, checkpoint_name: str, cache: SessionCache = PROCESS) -> dict[str, float]:
    """Metrics of ``checkpoint_name``; reuses the in-memory model when it is that checkpoint."""
    store = open_store(config)
    warm = cache.peek(config, store, checkpoint_name)
    if warm is not None:
        recipe, model, device = warm.recipe, warm.model, warm.device
    else:
        recipe, device = load_recipe(config), sessions.pick_device(config)
        model = recipe.build_model().to(device)
        model.load_state_dict(_model_weights(store, checkpoint_name))
    # In training's micro-batches, not the global batch: one process must hold this batch's activations.
    world = config.nproc_per_node * config.nnodes
    batch = RunContext.of(config, world_size=world).micro_batch_size
    metrics = evaluate_model(recipe, model, device, batch, recipe.ctx)
    info = store.info(checkpoint_name)
    if metrics and info is not None:  # the run's final evaluation, on its curves at the checkpoint's step
        step = int(info.manifest.progress.get("step", 0))
        log = metrics_for(config, store)
        log.start(step)
        log.log(step, {f"eval/{k}": v for k, v in metrics.items()})
        log.end()
    return metrics


def _model_weights(store, name: str) -> dict:
    info = store.info(name)
    if info is not None and info.manifest.metadata.get("parallelism") == "fsdp":
        from checkpointing.commit import sharded

        return sharded.consolidated_model(store, info)  # the whole model, in this process, for evaluation
    return store.load(name, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]


def evaluate_model(
    recipe,
    model: torch.nn.Module,
    device: torch.device,
    batch_size: int,
    ctx: RunContext | None = None,
    between_batches: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Sample-weighted means of ``recipe.evaluate`` over its eval split ({} without one), under the run's
    autocast. The loader has its own generator: evaluating never moves the training RNG streams.
    ``between_batches`` is called before each batch (it may raise to cut the evaluation short)."""
    hooks = Hooks.of(recipe)
    if hooks.eval_dataset is None or hooks.evaluate is None:
        return {}
    evaluate = hooks.evaluate
    dataset = hooks.eval_dataset()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=hooks.collate_fn,
        generator=torch.Generator().manual_seed(0),
    )
    totals: dict[str, float] = {}
    count = 0
    was_training = model.training
    model.eval()
    autocast = ctx.autocast() if ctx is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), autocast:
            for batch in loader:
                if between_batches is not None:
                    between_batches()
                n = _batch_len(batch)
                for k, v in evaluate(model, to_device(batch, device)).items():
                    totals[k] = totals.get(k, 0.0) + float(v) * n
                count += n
    finally:
        model.train(was_training)
    return {k: v / max(count, 1) for k, v in totals.items()}


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _batch_len(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    return _batch_len(batch[0])
