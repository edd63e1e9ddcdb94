"""Recipes: the user's model, data and loss, loaded by import path.

A recipe is any class with::

    __init__(**recipe_args)
    build_model() -> nn.Module
    train_dataset() -> map-style Dataset (the index is the sample id)
    build_optimizer(model) -> Optimizer
    build_scheduler(optimizer) -> LRScheduler | None        (optional; stepped once per optimizer step)
    loss(model, batch) -> scalar Tensor
    eval_dataset() -> Dataset                                (optional)
    evaluate(model, batch) -> dict[str, float]               (optional; averaged over samples)
    on_train_batch(sample_ids: list[int])                    (optional; the ids this process trains on next)
    collate_fn                                               (optional attribute for the DataLoader)

``loss`` returns the mean over its batch: with several processes, each one's loss is weighted by its
share of the global batch so that the averaged gradient is the global batch's mean.

The product owns the sampler and the DataLoader, and so the data position.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from training.config import ConfigError, TrainConfig

_REQUIRED = ("build_model", "train_dataset", "build_optimizer", "loss")


class Recipe(Protocol):
    def build_model(self) -> Any: ...
    def train_dataset(self) -> Any: ...
    def build_optimizer(self, model: Any) -> Any: ...
    def loss(self, model: Any, batch: Any) -> Any: ...


def load_recipe(config: TrainConfig) -> Recipe:
    """Imports and constructs the recipe; any mistake is a ConfigError naming the option."""
    module_name, _, class_name = config.recipe.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        raise ConfigError(
            f"recipe={config.recipe!r}: cannot import {module_name!r} ({exc}); "
            f"check the module path and that it is installed"
        ) from exc
    except AttributeError as exc:
        raise ConfigError(f"recipe={config.recipe!r}: {module_name!r} has no {class_name!r}") from exc
    try:
        recipe = cls(**config.recipe_args)
    except TypeError as exc:
        raise ConfigError(f"recipe_args={config.recipe_args!r}: {class_name} rejected them ({exc})") from exc
    missing = [m for m in _REQUIRED if not callable(getattr(recipe, m, None))]
    if missing:
        raise ConfigError(
            f"recipe={config.recipe!r}: missing method(s) {', '.join(missing)}; a recipe needs {', '.join(_REQUIRED)}"
        )
    return recipe
