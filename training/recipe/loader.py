"""Recipes: the user's model, data and loss, loaded only from what the worker allows.

A recipe is any class with::

    __init__(**recipe_args)
    build_model() -> nn.Module
    train_dataset() -> map-style Dataset (the index is the sample id; training.data.ShardedDataset for shards)
    build_optimizer(model) -> Optimizer
    build_scheduler(optimizer) -> LRScheduler | None        (optional; stepped once per optimizer step)
    loss(model, batch) -> scalar Tensor
    train_step(ctx, batch) -> loss                           (optional; replaces the product's step, below)
    state_dict() / load_state_dict(state)                    (optional; more state to checkpoint, e.g. a
                                                              second optimizer)
    eval_dataset() -> Dataset                                (optional)
    evaluate(model, batch) -> dict[str, float]               (optional; averaged over samples)
    on_train_batch(sample_ids: list[int])                    (optional; the ids this process trains on next)
    collate_fn                                               (optional attribute for the DataLoader)

``loss`` returns the mean over its batch: with several processes, each one's loss is weighted by its
share of the global batch so that the averaged gradient is the global batch's mean.

``self.ctx`` (a ``training.recipe.context.RunContext``) is set right after construction: batch sizes, world,
seed, precision, and ``ctx.total_steps`` once ``train_dataset()`` was called (for LR schedules).

The product's step, per optimizer step: zero the gradients; for each of ``grad_accumulation``
micro-batches, ``loss(model, batch)`` under autocast and a weighted (and for fp16 scaled) backward,
with DDP's gradient sync only on the last; clip to ``grad_clip_norm``; step; step the scheduler. A
recipe whose step is different (several optimizers, a GAN) defines ``train_step(ctx, batch)``: it is
called once per optimizer step with this process's whole share of the global batch, on the device, and
does zero_grad/forward/backward/step itself, using ``ctx.model``, ``ctx.autocast()``,
``ctx.backward(loss)`` (weights and scales) and ``ctx.step(*optimizers)`` (clips, steps, updates the
scaler). The product still owns the data position, the scheduler step, checkpoints and RNG.

A recipe that finds its arguments or its inputs unusable raises ``training.config.ConfigError`` (one line at
the terminal, never retried); any other exception in a unit is retried. Build a ``LambdaLR`` from a plain
function or closure, not a callable object: ``LambdaLR.state_dict`` saves a callable object's attributes
and restores them over the new ones (e.g. an old total step count after a batch-size change).

Trust: ``recipe`` and ``recipe_args`` arrive as flow-run parameters, from anyone allowed to create runs.
Importing a module and calling a class is running code, so a run may only name a recipe that the
process's own environment allows: one registered under the ``resumable_train.recipes`` entry-point
group of an installed package, or listed in ``TRAIN_ALLOWED_RECIPES`` (``module:Class`` or
``name=module:Class``, comma-separated). The check happens before anything is imported. Whoever runs
``python -m flows.train`` by hand allows the recipe on their own command line (``allow_recipe``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
from typing import TYPE_CHECKING, Any, Protocol

from training.config import ConfigError, TrainConfig
from training.recipe.hooks import REQUIRED, Hooks, missing_required

if TYPE_CHECKING:  # imported where a recipe is loaded: it imports torch, which a refused launch never needs
    from training.recipe.context import RunContext

ENTRY_POINT_GROUP = "resumable_train.recipes"
ALLOWED_ENV = "TRAIN_ALLOWED_RECIPES"
_allowed_in_process: set[str] = set()


class Recipe(Protocol):
    ctx: Any  # the run context, set by load_recipe

    def build_model(self) -> Any: ...
    def train_dataset(self) -> Any: ...
    def build_optimizer(self, model: Any) -> Any: ...
    def loss(self, model: Any, batch: Any) -> Any: ...


def _check_path(path: str, where: str) -> str:
    if not _is_import_path(path):
        raise ConfigError(f"{where}: {path!r} is not an import path 'package.module:ClassName'")
    return path


@functools.cache
def installed_recipes() -> tuple[tuple[str, str], ...]:
    """The recipes installed packages declare (entry points of ``ENTRY_POINT_GROUP``): name, 'module:Class'. Read
    once per process (``process_state.reset`` forgets it): reading them scans every installed distribution, ~6 ms,
    and a unit resolves its recipe several times."""
    return tuple((ep.name, ep.value) for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def allowed_recipes() -> dict[str, str]:
    """Every recipe this process may load: name -> 'module:Class' (an allowed path is its own name too)."""
    allowed = dict(installed_recipes())
    for item in os.environ.get(ALLOWED_ENV, "").split(","):
        name, sep, path = item.strip().partition("=")
        if name:
            path = path if sep else name
            allowed[name.strip()] = _check_path(path.strip(), ALLOWED_ENV)
    for path in _allowed_in_process:
        allowed[path] = path
    return allowed


def allow_recipe(path: str) -> None:
    """Lets this process (and the torchrun units it starts) load ``path``: for the person who runs
    ``python -m flows.train --recipe pkg.mod:Cls`` by hand, or Python code that calls ``train()`` itself."""
    _allowed_in_process.add(_check_path(path, "allow_recipe"))


def resolve_recipe(value: str) -> str:
    """The import path of ``value`` (a name or a path) if this process may load it; nothing is imported."""
    allowed = allowed_recipes()
    if value in allowed:
        return allowed[value]
    if value in allowed.values():
        return value
    names = ", ".join(sorted(n for n in allowed if ":" not in n)) or "none"
    path = value if _is_import_path(value) else "module:Class"
    raise ConfigError(
        f"recipe={value!r} is not allowed on this worker (allowed by name: {names}); a recipe is code, so whoever "
        f"starts the process allows it: from Python, `from flows.train import allow_recipe; allow_recipe({path!r})` "
        f"before train(); on the command line, `python -m flows.train --recipe {path}` allows it for that command; "
        f"for a worker's deployment runs, {ALLOWED_ENV}='{path}' in the worker's environment or an entry point in the "
        f"'{ENTRY_POINT_GROUP}' group of an installed package (docs/recipes.md)"
    )


def _is_import_path(value: str) -> bool:
    module, sep, attr = value.partition(":")
    return bool(sep) and all(p.isidentifier() for p in [*module.split("."), attr])


def recipe_class(config: TrainConfig) -> type:
    """Imports the allowed recipe class and checks that it is one, without calling anything of it."""
    path = resolve_recipe(config.recipe)
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        raise ConfigError(
            f"recipe={config.recipe!r}: cannot import {module_name!r} ({exc}); check the module path and that it "
            f"is installed"
        ) from exc
    except AttributeError as exc:
        raise ConfigError(f"recipe={config.recipe!r}: {module_name!r} has no {class_name!r}") from exc
    if not inspect.isclass(cls):
        raise ConfigError(f"recipe={config.recipe!r}: {path} is a {type(cls).__name__}, not a recipe class")
    missing = missing_required(cls)
    if missing:
        raise ConfigError(
            f"recipe={config.recipe!r}: {path} is not a recipe: no {', '.join(missing)}; a recipe defines "
            f"{', '.join(REQUIRED)} (or train_loop for a loop of its own)"
        )
    return cls


def uses_own_loop(config: TrainConfig) -> bool:
    """Whether the recipe brings its own loop (``train_loop``), which then wins over build_model/loss/..."""
    return Hooks.of(recipe_class(config)).own_loop


def load_recipe(config: TrainConfig, ctx: RunContext | None = None) -> Recipe:
    """Constructs the recipe with ``recipe_args`` and sets ``recipe.ctx`` (``ctx``, or a single-process
    context); any mistake is a ConfigError naming them."""
    cls = recipe_class(config)
    try:
        recipe: Any = cls(**config.recipe_args)
    except Exception as exc:  # a recipe's own validation may raise anything: it is the arguments' fault
        raise ConfigError(
            f"recipe_args={config.recipe_args!r}: {cls.__name__} rejected them ({type(exc).__name__}: {exc})"
        ) from exc
    from training.recipe.context import RunContext  # torch: not for a launch its checks refuse (launch_checks.py)

    recipe.ctx = ctx or RunContext.of(config)
    return recipe


def open_dataset(recipe: Any) -> Any:
    """``recipe.train_dataset()``, its size recorded in ``recipe.ctx`` (for ``ctx.total_steps``)."""
    from training.recipe.context import RunContext

    dataset = _check_addressable(recipe, recipe.train_dataset())
    if isinstance(recipe.ctx, RunContext):
        recipe.ctx.num_train_samples = len(dataset)
    return dataset


def _check_addressable(recipe: Any, dataset: Any) -> Any:
    """The product owns the data position by sample id, or a stateful stream's position by its state
    (training/position/iterable.py): any other dataset is refused in one line, never trained on and restarted from its
    beginning after a resume."""
    from torch.utils.data import IterableDataset

    from training.position.iterable import StatefulIterable, is_stateful

    if not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return dataset
    name = f"{type(recipe).__module__}.{type(recipe).__name__}"
    what = type(dataset).__name__
    if is_stateful(dataset):
        stream = StatefulIterable(dataset)
        for option in ("max_duration", "save_interval"):
            duration = getattr(recipe.ctx, option, None)
            if not hasattr(dataset, "__len__") and getattr(duration, "unit", None) == "ep":
                raise ConfigError(
                    f"{option}={duration}: recipe {name}'s train_dataset() returned {what}, a stream without len(), "
                    f"so it has no epochs; give {option} in samples or batches ('<n>sp', '<n>ba')"
                )
        return stream
    why = "it has no len() and no state, so a resume would start its epoch over"
    raise ConfigError(
        f"recipe {name}: train_dataset() returned {what}, a stream the product cannot address by sample id ({why}); "
        f"return training.data.ShardedDataset(url, format) over its shards (tokens, jsonl or parquet), which resumes "
        f"exactly across kills, batch size and world size changes, or a map-style Dataset"
    )


def describe_recipe(config: TrainConfig) -> str:
    return f"recipe {config.recipe!r} with recipe_args={config.recipe_args!r}"
