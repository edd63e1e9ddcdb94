"""A sweep's search space: Ray Tune's distributions, as plain data that a flow-run parameter or a file can carry.

A space maps a trial option to a distribution::

    {"recipe_args.lr": {"loguniform": [1e-4, 1e-1]},   # tune.loguniform
     "recipe_args.hidden": {"choice": [32, 64, 128]},  # tune.choice
     "recipe_args.dropout": {"uniform": [0.0, 0.5]},   # tune.uniform
     "recipe_args.layers": {"randint": [1, 4]},        # tune.randint: 1, 2 or 3
     "global_batch_size": {"grid": [32, 64]}}          # tune.grid_search

Keys are ``recipe_args.<name>`` or one of the training options in ``OPTIONS``; never what names a run, its
store, its code or its credentials. ``trial_parameters`` expands it the way Ray Tune's BasicVariantGenerator does:
every combination of the ``grid`` values, ``num_samples`` times over, the other distributions drawn from one seeded
generator in key order, so that a relaunched sweep draws the same trials whatever order the space was written in.
``perturb`` is PBT's explore step within the same space.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from typing import Any

from training.exceptions import ConfigError

KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
_DISCRETE = ("grid", "choice")
_INTEGER = ("grid", "choice", "randint")
# The training options a sweep may search, and the distributions that give each a value of its type.
OPTIONS: dict[str, tuple[str, ...]] = {
    "global_batch_size": _INTEGER,
    "grad_accumulation": _INTEGER,
    "seed": _INTEGER,
    "grad_clip_norm": KINDS,
    "precision": _DISCRETE,
    "shuffle": _DISCRETE,
    "eval_interval": _DISCRETE,
}
MAX_VALUES = 1000  # values of one grid or choice
MAX_KEYS = 100
MAX_TRIALS = 10_000

Space = dict[str, dict[str, list[Any]]]
_EXAMPLE = "{'recipe_args.lr': {'loguniform': [1e-4, 1e-1]}}"


def check_space(space: Any, option: str = "space") -> Space:
    """``space`` typed and bounded, or one ConfigError naming the key, the value and the fix."""
    if not isinstance(space, Mapping) or not space or len(space) > MAX_KEYS:
        raise ConfigError(f"{option}: give a mapping of 1 to {MAX_KEYS} options to distributions, e.g. {_EXAMPLE}")
    checked: Space = {}
    for key, spec in space.items():
        _check_key(key, option)
        where = f"{option}[{key!r}]"
        if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ConfigError(f"{where}: give one of {', '.join(KINDS)} with its values, e.g. {{'choice': [1, 2]}}")
        kind, values = next(iter(spec.items()))
        allowed = OPTIONS.get(key, KINDS)
        if kind not in allowed:
            raise ConfigError(f"{where}: {key} takes whole values; use one of {', '.join(allowed)}, not {kind}")
        checked[key] = {kind: _check_values(kind, values, where)}
    return checked


def _check_key(key: Any, option: str) -> None:
    if not isinstance(key, str) or len(key) > 100:
        raise ConfigError(f"{option}: its keys are option names, e.g. 'recipe_args.lr'")
    prefix, dot, name = key.partition(".")
    if (prefix == "recipe_args" and dot and name.isidentifier()) or (not dot and key in OPTIONS):
        return
    raise ConfigError(
        f"{option}: {key!r} cannot be searched; use 'recipe_args.<argument>' or one of {', '.join(sorted(OPTIONS))}"
    )


def _check_values(kind: str, values: Any, where: str) -> list[Any]:
    if not isinstance(values, list) or not values or len(values) > MAX_VALUES:
        raise ConfigError(f"{where}: {kind} takes a list of 1 to {MAX_VALUES} values, e.g. {{'{kind}': [1, 2]}}")
    if kind in _DISCRETE:
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in values):
            raise ConfigError(f"{where}: {kind} values are numbers, strings, booleans or null")
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{where}: {kind} values must be finite numbers")
        return list(values)
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: {kind} takes [low, high], two numbers")
    low, high = values
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(f"{where}: {kind} needs finite low < high, got [{low!r}, {high!r}]")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0, got {low!r}")
    if kind == "randint" and not (isinstance(low, int) and isinstance(high, int)):
        raise ConfigError(f"{where}: randint takes integers [low, high) (high excluded, as in Ray Tune)")
    return [low, high]


def count_trials(space: Space, num_samples: int) -> int:
    """How many trials the space makes: the grid's combinations times ``num_samples``."""
    return num_samples * math.prod(len(spec["grid"]) for spec in space.values() if "grid" in spec)


def trial_parameters(space: Space, num_samples: int, seed: int) -> list[dict[str, Any]]:
    """Every trial's parameters in trial order: each grid combination ``num_samples`` times, with the other
    distributions drawn from a generator seeded by ``seed`` (Ray Tune's expansion)."""
    count = count_trials(space, num_samples)
    if not 1 <= count <= MAX_TRIALS:
        raise ConfigError(
            f"num_samples={num_samples}: the space makes {count} trials; keep it 1 to {MAX_TRIALS} (fewer grid "
            f"values or samples)"
        )
    keys = sorted(space)
    grids = [key for key in keys if "grid" in space[key]]
    rng = random.Random(seed)
    trials = []
    for _ in range(num_samples):
        for combination in itertools.product(*(space[key]["grid"] for key in grids)):
            params = dict(zip(grids, combination, strict=True))
            for key in keys:
                if key not in params:
                    params[key] = draw(space[key], rng)
            trials.append({key: params[key] for key in keys})
    return trials


def draw(spec: Mapping[str, list[Any]], rng: random.Random) -> Any:
    """One value of a checked distribution."""
    kind, values = next(iter(spec.items()))
    if kind in _DISCRETE:
        return values[rng.randrange(len(values))]
    low, high = values
    if kind == "uniform":
        return rng.uniform(low, high)
    if kind == "loguniform":
        return math.exp(rng.uniform(math.log(low), math.log(high)))
    return rng.randrange(low, high)  # randint: high excluded


def perturb(
    params: Mapping[str, Any],
    space: Space,
    rng: random.Random,
    resample_probability: float = 0.25,
    factors: tuple[float, float] = (0.8, 1.2),
) -> dict[str, Any]:
    """PBT's explore (Ray's ``PopulationBasedTraining``): each value resampled from its distribution with
    ``resample_probability``, otherwise a number scaled by one of ``factors`` (kept inside its range, an integer
    stays one) or a choice moved to a neighbour. Grid values are the sweep's design and stay."""
    explored = dict(params)
    for key in sorted(space):
        kind, values = next(iter(space[key].items()))
        if kind == "grid":
            continue
        if rng.random() < resample_probability or key not in params:
            explored[key] = draw(space[key], rng)
        elif kind == "choice":
            i = values.index(params[key]) if params[key] in values else 0
            explored[key] = values[min(max(i + rng.choice((-1, 1)), 0), len(values) - 1)]
        else:
            low, high = values
            scaled = params[key] * rng.choice(factors)
            if kind == "randint":
                explored[key] = min(max(round(scaled), low), high - 1)
            else:
                explored[key] = min(max(scaled, low), high)
    return explored


def apply(base: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (TrainConfig fields) with a trial's parameters set: ``recipe_args.x`` inside ``recipe_args``."""
    fields = dict(base)
    recipe_args = dict(fields.get("recipe_args") or {})
    for key, value in params.items():
        _, dot, name = key.partition(".")
        if dot:
            recipe_args[name] = value
        else:
            fields[key] = value
    fields["recipe_args"] = recipe_args
    return fields
