"""Warm start from ``load_path`` weights: checked against the model before anything is written, then loaded.

``load_path`` names a checkpoint or run folder (its full state, or its weights with ``load_weights_only``)
or a weights file from anywhere (``checkpointing.weights``). Weights are matched to the recipe's model
by key and shape under ``load_strict`` and ``load_ignore_keys``. The flow calls ``check_load_path``
first, on a model built on the meta device (shapes, no memory), so a mismatch fails the run before it
claims or writes anything; the unit then calls ``load_weights`` and reads the weights once more.
"""

from __future__ import annotations

import json
import logging

import torch

from checkpointing import CheckpointStore, NotACheckpointError, UnsafeCheckpointError, open_checkpoint_uri
from checkpointing.store import STATE_FILE
from checkpointing.weights import Weights, WeightsError, check_match, is_weights_file, load_into, match, read_weights
from training.config import ConfigError, TrainConfig
from training.recipe import load_recipe

logger = logging.getLogger(__name__)


def load_weights(config: TrainConfig, model: torch.nn.Module) -> str | None:
    """Loads ``load_path``'s weights into ``model`` when weights are what it gives (a weights file, or a
    folder with load_weights_only) and says where they came from; None when a folder's full state is wanted."""
    found = _read(config)
    if found is None:
        return None
    weights, origin = found
    try:
        report = load_into(
            model,
            weights.state_dict,
            strict=config.load_strict,
            ignore_keys=config.load_ignore_keys,
            where=_where(config),
        )
    except WeightsError as exc:
        raise ConfigError(str(exc)) from exc
    if report.stripped_prefix:
        logger.info("load_path: stripped the prefix %r that wraps every key of the file", report.stripped_prefix)
    if not config.load_weights_only:
        logger.info("load_path is a weights file: weights only; optimizer, scheduler and progress start fresh")
    logger.info("load_path: %s (%s)", report.summary(), weights.description)
    return origin


def check_before_start(config: TrainConfig) -> None:
    """``check_load_path`` for ``python -m flows.train`` before Prefect starts, so that a bad load_path is one
    line, not a failed flow run's traceback and then the line. Only when the run has no checkpoint yet: a
    run that resumes ignores load_path (its file may be long gone)."""
    if (
        config.load_path
        and CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options).latest()
        is None
    ):
        check_load_path(config)


def check_load_path(config: TrainConfig) -> None:
    """Everything about ``load_path`` that can fail, checked before the run writes anything: the URI names
    a checkpoint or a readable, safe weights file, and its weights fit the recipe's model. A config that
    passed once in this process is not read again (the unit still checks what it loads)."""
    key = _check_key(config)
    if key in _passed:
        return
    try:
        found = _read(config)
        if found is None:
            if config.load_ignore_keys or not config.load_strict:
                raise ConfigError(
                    f"load_path={config.load_path!r} is a checkpoint folder and load_weights_only=false: its full "
                    f"state must match; load_strict and load_ignore_keys apply to weights: set load_weights_only=true"
                )
            open_checkpoint_uri(str(config.load_path), storage_options=config.storage_options, files=[])
            return
        _, report = match(_model_shapes(config), found[0].state_dict, ignore_keys=config.load_ignore_keys)
        check_match(report, _where(config), config.load_strict)
    except (WeightsError, NotACheckpointError, UnsafeCheckpointError) as exc:
        raise ConfigError(str(exc)) from exc
    _passed.add(key)


_passed: set[str] = set()


def _check_key(config: TrainConfig) -> str:
    fields = ("load_path", "load_weights_only", "load_strict", "load_ignore_keys", "recipe", "recipe_args")
    return json.dumps([getattr(config, f) for f in fields], sort_keys=True, default=str)


def _read(config: TrainConfig) -> tuple[Weights, str] | None:
    uri, options = str(config.load_path), config.storage_options
    if is_weights_file(uri, options):
        weights = read_weights(uri, options)
        return weights, f"weights of {uri} (load_path: {weights.description})"
    if not config.load_weights_only:
        return None
    loaded = open_checkpoint_uri(uri, storage_options=options, files=[STATE_FILE])
    weights = Weights(loaded.objects[STATE_FILE]["state"]["model"], f"checkpoint {loaded.info.name}")
    return weights, f"weights of {loaded.info.uri} (load_path)"


def _model_shapes(config: TrainConfig) -> dict[str, torch.Size]:
    """The recipe model's ``{key: shape}``, built on the meta device (no memory, no init work)."""
    recipe = load_recipe(config)
    try:
        with torch.device("meta"):
            model = recipe.build_model()
    except Exception:  # a build_model that cannot run on the meta device (it reads a file, say): build it for real
        model = recipe.build_model()
    return {k: v.shape for k, v in model.state_dict().items()}


def _where(config: TrainConfig) -> str:
    return f"load_path={config.load_path!r}"
