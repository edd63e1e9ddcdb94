"""Pre-flight: build what the run needs once, before anything is written.

A mistake in ``recipe_args`` (a negative width, a dataset that cannot be built) would otherwise surface
in the first unit, after the run folder was claimed, be retried, and end in a traceback that does not
name the argument. Here it is one ConfigError naming the recipe and its arguments, never retried. The
model is built on PyTorch's meta device (shapes, no memory), and for real only if that fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from checkpointing.io.hashing import sha256_hex
from training.config import ConfigError, TrainConfig
from training.config.machines import check_multinode
from training.recipe.hooks import Hooks
from training.recipe.loader import describe_recipe, load_recipe, open_dataset, uses_own_loop

logger = logging.getLogger(__name__)
# Options of the unit loop that a loop of the user's own cannot honour: set explicitly, they earn a warning.
IGNORED_BY_CUSTOM_LOOPS = (
    "save_interval",
    "eval_interval",
    "eval_each_unit",
    "grad_clip_norm",
    "grad_accumulation",
    "ignore_data_skip",
    "data_skip_steps",
    "num_workers",
    "log_every_n_steps",
)

MAX_EPOCH_SAMPLES = 2**31 - 1  # the epoch's sample order is a permutation held in memory (8 bytes a sample)
_passed: set[str] = set()


def preflight(config: TrainConfig) -> int:
    """Constructs the recipe, opens its dataset and builds its model, optimizer and scheduler; returns the
    number of training samples. Raises ConfigError naming the recipe and recipe_args.

    A recipe with its own ``train_loop`` builds everything inside the loop: only its constructor and the
    options are checked, and 0 is returned (the product never sees its data)."""
    check_multinode(config)  # several machines: the pool's secret and this node's address are there
    if uses_own_loop(config):
        check_own_loop(config)
        return 0
    key = sha256_hex(config.model_dump_json().encode())
    recipe = load_recipe(config)
    where = describe_recipe(config)
    dataset = _calling(where, "train_dataset()", lambda: open_dataset(recipe))
    size = _calling(where, "len(train_dataset())", lambda: len(dataset))
    if not isinstance(size, int) or not 1 <= size <= MAX_EPOCH_SAMPLES:
        raise ConfigError(f"{where}: train_dataset() has {size!r} samples; use between 1 and {MAX_EPOCH_SAMPLES}")
    check_options(config, recipe)
    if key not in _passed:
        try:
            with torch.device("meta"):
                _build(recipe, where)
        except ConfigError:
            _build(recipe, where)  # some models cannot be built on the meta device; the real build decides
        _passed.add(key)
    return size


TRAIN_METRICS = ("train_loss", "samples", "train_seconds", "samples_per_second", "checkpoint_seconds")


def check_own_loop(config: TrainConfig) -> None:
    """Start-up checks for a recipe with ``train_loop``: it constructs, and no option asks for what the loop owns."""
    if config.parallelism == "fsdp":
        raise ConfigError(
            "parallelism='fsdp': a recipe with train_loop shards nothing itself (its reports commit rank 0's "
            "state); use parallelism='ddp' and shard inside train_loop, or a recipe with build_model/loss for FSDP"
        )
    load_recipe(config)  # its constructor's complaints about recipe_args, as one ConfigError
    ignored = sorted(set(config.model_fields_set) & set(IGNORED_BY_CUSTOM_LOOPS))
    if ignored:
        logger.warning(
            "%s: not used with a recipe that has train_loop (the loop decides when to report)", ", ".join(ignored)
        )


def check_options(config: TrainConfig, recipe: Any) -> None:
    """Options that depend on what the recipe defines: refused now, not silently ignored later."""
    hooks = Hooks.of(recipe)
    if hooks.train_step is not None and config.grad_accumulation > 1:
        raise ConfigError(
            f"grad_accumulation={config.grad_accumulation}: {type(recipe).__name__} has its own train_step, which gets "
            f"the process's whole share of the batch; split it there (ctx.grad_accumulation), or leave "
            f"grad_accumulation=1"
        )
    attribute = config.checkpoint_score_attribute
    if attribute is None:
        return
    known = [*TRAIN_METRICS, *(["grad_norm"] if config.grad_clip_norm is not None else [])]
    evaluates = hooks.evaluates
    if attribute.startswith("eval_"):
        if not evaluates:
            raise ConfigError(
                f"checkpoint_score_attribute={attribute!r}: {type(recipe).__name__} has no eval_dataset/evaluate, "
                f"so no checkpoint reports it; use one of {', '.join(known)}"
            )
        if config.eval_every is None:
            raise ConfigError(
                f"checkpoint_score_attribute={attribute!r}: evaluation runs only at the end, so no checkpoint "
                f"would report it; set eval_interval (e.g. eval_interval={config.save_interval!r})"
            )
    elif attribute not in known:
        hint = " or eval_<metric> with eval_interval set" if evaluates else ""
        raise ConfigError(
            f"checkpoint_score_attribute={attribute!r}: no unit reports it; use one of {', '.join(known)}{hint}"
        )


def _build(recipe: Any, where: str) -> None:
    model = _calling(where, "build_model()", recipe.build_model)
    optimizer = _calling(where, "build_optimizer(model)", lambda: recipe.build_optimizer(model))
    build_scheduler = Hooks.of(recipe).build_scheduler
    if build_scheduler is not None:
        _calling(where, "build_scheduler(optimizer)", lambda: build_scheduler(optimizer))


def _calling(where: str, what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # the recipe's own code, called with the run's arguments
        raise ConfigError(f"{where}: {what} failed: {type(exc).__name__}: {exc}") from exc
