"""A recipe's optional methods, read once (Lightning's ``core/hooks.py`` + ``is_overridden``).

Which of them a recipe defines decides how a run trains: its own ``train_loop`` replaces the unit loop, its own
``train_step`` replaces the product's step, ``state_dict`` adds to what is checkpointed. They are looked up here,
once per recipe, and everything else asks ``Hooks``, instead of probing the recipe with ``getattr`` at each use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUIRED = ("build_model", "train_dataset", "build_optimizer", "loss")
OPTIONAL = (
    "build_scheduler",
    "train_step",
    "on_train_batch",
    "state_dict",
    "load_state_dict",
    "eval_dataset",
    "evaluate",
    "train_loop",
)


@dataclass(frozen=True)
class Hooks:
    """The optional methods a recipe (or recipe class) defines; None where it does not."""

    build_scheduler: Callable[..., Any] | None = None
    train_step: Callable[..., Any] | None = None
    on_train_batch: Callable[..., Any] | None = None
    state_dict: Callable[..., Any] | None = None
    load_state_dict: Callable[..., Any] | None = None
    eval_dataset: Callable[..., Any] | None = None
    evaluate: Callable[..., Any] | None = None
    train_loop: Callable[..., Any] | None = None
    collate_fn: Callable[..., Any] | None = None  # an attribute handed to the DataLoader, not a hook

    @classmethod
    def of(cls, recipe: Any) -> Hooks:
        """The hooks of a recipe instance (bound methods) or of a recipe class (functions)."""
        found = {name: _callable(recipe, name) for name in OPTIONAL}
        return cls(**found, collate_fn=_callable(recipe, "collate_fn"))

    @property
    def evaluates(self) -> bool:
        return self.eval_dataset is not None and self.evaluate is not None

    @property
    def own_loop(self) -> bool:
        return self.train_loop is not None


def missing_required(recipe_class: type) -> list[str]:
    """The required methods a class lacks (a class with ``train_loop`` needs none of them)."""
    if _callable(recipe_class, "train_loop") is not None:
        return []
    return [name for name in REQUIRED if _callable(recipe_class, name) is None]


def _callable(obj: Any, name: str) -> Callable[..., Any] | None:
    value = getattr(obj, name, None)
    return value if callable(value) else None
