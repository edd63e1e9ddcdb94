"""What makes a run the same run: the recipe, its arguments, the seed and the sample order.

A checkpoint records them (manifest metadata ``config``); a launch that differs in any of them would
load weights into a model of another shape, or continue an epoch in another order, so it is refused
at start-up with one line naming the fields, before anything is written, and never retried. Durations,
batch size, world size, retention and storage options may change between launches.

One exception, MindSpore Transformers' "resume with the dataset changed": a launch that differs only in what feeds
the data (``recipe_args``, ``seed``, ``shuffle``; never the recipe) and sets ``ignore_data_skip=true`` or
``data_skip_steps=<n>`` continues the run on the new data, optimizer state and progress included: the option places
it in the new data (training/unit/session.py ``reposition``, once per change), the checkpoint must still fit the
model and optimizer the recipe now builds (checked at start-up, before the claim), and a warning names what changed.
Its next checkpoint records the new configuration. The refusal names these options beside ``load_weights_only``.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any

from checkpointing import CheckpointInfo, CheckpointStore
from training.config import ConfigError, TrainConfig
from training.recipe.loader import recipe_class, resolve_recipe

logger = logging.getLogger(__name__)
# A same-run relaunch on changed data, as MindSpore Transformers' resume with the dataset changed
DATA_SKIP = (
    "ignore_data_skip=true (the current epoch restarts at the first sample of the new data) or data_skip_steps=<n> "
    "(it resumes after n of its batches)"
)


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


def requested_data_skip(config: TrainConfig) -> dict[str, Any] | None:
    """What the data-skip options ask for, on this run's data (``data``: the fingerprint of what feeds it). The
    checkpoint records it once applied (``data_skip_applied``), so a restart does not apply it again, while a later
    change of the data with the same option does."""
    if not config.ignore_data_skip and config.data_skip_steps is None:
        return None
    return {
        "ignore_data_skip": config.ignore_data_skip,
        "data_skip_steps": config.data_skip_steps,
        "data": config.fingerprint(),
    }


def same_data_skip(requested: dict[str, Any] | None, applied: Any) -> bool:
    """Whether ``requested`` is what the checkpoint's ``applied`` record says was applied already (a record from
    before the data's fingerprint was kept stands for any data)."""
    if requested is not None and isinstance(applied, dict) and "data" not in applied:
        return {k: v for k, v in requested.items() if k != "data"} == applied
    return requested == applied


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
            # (read only when they differ: the recipe's import costs torch's, ~2 s, for a refusal that needs none)
            same_recipe = recorded.get("recipe") == mine["recipe"]
            defaults = recipe_defaults(config) if same_recipe and theirs != value else {}
            for arg in sorted(set(theirs) | set(value)):
                old, new = theirs.get(arg, defaults.get(arg)), value.get(arg, defaults.get(arg))
                if old != new:
                    found.append(f"recipe_args.{arg}: {old!r} -> {new!r}")
        elif recorded.get(key) != value:
            found.append(f"{key}: {recorded.get(key)!r} -> {value!r}")
    return found


def check_same_run(config: TrainConfig, info: CheckpointInfo, store: CheckpointStore | None = None) -> None:
    """ConfigError (never retried) when ``config`` would continue ``info`` with another model or data order; a change
    of the data alone passes with ``ignore_data_skip``/``data_skip_steps`` (the module's docstring). With ``store``
    (the start-up check, ``info`` being a checkpoint there), such a change must also fit the recipe's model and
    optimizer."""
    found = differences(config, info)
    if not found:
        return
    own_loop = bool(info.manifest.metadata.get("train_loop"))
    data_only = not own_loop and not any(f.startswith(("recipe:", "recipe,")) for f in found)  # recipe, or unknown
    if data_only and (config.ignore_data_skip or config.data_skip_steps is not None):
        if store is not None:
            _check_fits(config, store, info)
        option = "ignore_data_skip=true" if config.ignore_data_skip else f"data_skip_steps={config.data_skip_steps}"
        logger.warning(
            "run_name=%r continues on changed data (%s; checkpoint %s) with its optimizer state and progress: %s "
            "places it in the new data",
            config.run_name,
            "; ".join(found),
            info.name,
            option,
        )
        return
    if own_loop:  # a loop of its own: what load_path hands it is its state
        fix = (
            f"start a new run from its reported state with load_path={info.uri!r} (ctx.get_checkpoint() then "
            f"returns that state; with load_weights_only=true, {{'model': ...}} of it)"
        )
    else:
        fix = f"start a new run from its weights with load_path={info.uri!r} load_weights_only=true"
        if data_only:
            fix += f"; or, if only its data changed, continue this run on it with {DATA_SKIP}"
    raise ConfigError(
        f"run_name={config.run_name!r} was trained with another configuration than this launch "
        f"({'; '.join(found)}; checkpoint {info.name}). To train this configuration, choose a new run_name, "
        f"or {fix}"
    )


def _check_fits(config: TrainConfig, store: CheckpointStore, info: CheckpointInfo) -> None:
    """The checkpoint a relaunch on changed data continues fits the model and optimizer the recipe now builds."""
    from checkpointing.store import STATE_FILE
    from training.start.carry_over import check_model_fits, check_optimizer_fits, optimizer_param_names
    from training.start.warm_start import WEIGHTS_ONLY, _recipe_objects

    state = store.load(info, [STATE_FILE]).objects[STATE_FILE]["state"]
    model, optimizer = _recipe_objects(config)
    what = f"run_name={config.run_name!r} (checkpoint {info.name}), continued on changed data,"
    fix = f"recipe_args change the model: choose a new run_name, or start one with load_path={info.uri!r} and {WEIGHTS_ONLY}"
    check_model_fits(model, state["model"], what, fix)
    if state.get("optimizer") is not None:
        check_optimizer_fits(optimizer, state["optimizer"], optimizer_param_names(model, optimizer), what, fix)
