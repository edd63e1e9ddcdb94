"""What makes a run the same run: the recipe, its arguments, the seed and the sample order.

A checkpoint records them (manifest metadata ``config``); a launch that differs in any of them would
load weights into a model of another shape, or continue an epoch in another order, so it is refused
at start-up with one line naming the fields, before anything is written, and never retried. Durations,
batch size, world size, retention and storage options may change between launches.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from checkpointing import CheckpointInfo
from training.config import ConfigError, TrainConfig
from training.recipe.loader import recipe_class, resolve_recipe


def run_identity(config: TrainConfig) -> dict[str, Any]:
    """The fields that define the model and the data order, with the recipe as its import path."""
    return {
        "recipe": resolve_recipe(config.recipe),
        "recipe_args": json.loads(json.dumps(config.recipe_args, sort_keys=True)),
        "seed": config.seed,
        "shuffle": config.shuffle,
    }


def recipe_defaults(config: TrainConfig) -> dict[str, Any]:
    """The recipe's keyword defaults that JSON can carry (what ``recipe_args`` left out means)."""
    try:
        parameters = inspect.signature(recipe_class(config)).parameters.values()
    except (TypeError, ValueError):
        return {}
    found = {}
    for p in parameters:
        if p.default is not inspect.Parameter.empty:
            try:
                found[p.name] = json.loads(json.dumps(p.default))
            except (TypeError, ValueError):
                continue
    return found


def differences(config: TrainConfig, info: CheckpointInfo) -> list[str]:
    """'field: checkpoint -> this launch' for each identity field that differs."""
    recorded = info.manifest.metadata.get("config")
    if not isinstance(recorded, dict):  # written before identities were recorded: compare the fingerprint
        old = info.manifest.metadata.get("config_fingerprint")
        return [] if old in (None, config.fingerprint()) else ["recipe, recipe_args, seed or shuffle"]
    mine = run_identity(config)
    found = []
    for key, value in mine.items():
        if key == "recipe_args":
            theirs = recorded.get(key) or {}
            theirs = theirs if isinstance(theirs, dict) else {}
            # an argument left out is the recipe's default: compare (and show) the values the runs really use
            defaults = recipe_defaults(config) if recorded.get("recipe") == mine["recipe"] else {}
            for arg in sorted(set(theirs) | set(value)):
                old, new = theirs.get(arg, defaults.get(arg)), value.get(arg, defaults.get(arg))
                if old != new:
                    found.append(f"recipe_args.{arg}: {old!r} -> {new!r}")
        elif recorded.get(key) != value:
            found.append(f"{key}: {recorded.get(key)!r} -> {value!r}")
    return found


def check_same_run(config: TrainConfig, info: CheckpointInfo) -> None:
    """ConfigError (never retried) when ``config`` would continue ``info`` with another model or data order."""
    found = differences(config, info)
    if not found:
        return
    if info.manifest.metadata.get("train_loop"):  # a loop of its own: what load_path hands it is its state
        fix = (
            f"start a new run from its reported state with load_path={info.uri!r} (ctx.get_checkpoint() then "
            f"returns that state; with load_weights_only=true, {{'model': ...}} of it)"
        )
    else:
        fix = f"start a new run from its weights with load_path={info.uri!r} load_weights_only=true"
    raise ConfigError(
        f"run_name={config.run_name!r} was trained with another configuration than this launch "
        f"({'; '.join(found)}; checkpoint {info.name}). To train this configuration, choose a new run_name, "
        f"or {fix}"
    )
