"""``search_alg='optuna'``: each new trial's parameters suggested by Optuna's TPE sampler from the trials before it.

Search is a well-kept library's job, not ours: this module only translates. The space's kinds become Optuna's
distributions (``choice`` a CategoricalDistribution, ``uniform`` a FloatDistribution, ``loguniform`` one with
``log=True``, ``randint [low, high)`` an IntDistribution(low, high - 1)); ``grid`` has no TPE meaning (Optuna's
GridSampler is another sampler) and SweepConfig refuses it, as it refuses PBT, whose population starts at once.

The ledger stays the only state. To suggest trial ``index``, ``suggest`` builds a fresh in-memory Optuna study from
the sweep's study, adds every trial created before (in index order, as it stands now) and asks once:

- completed with a final metric: COMPLETE, its value the metric at its last unit (the budget);
- any other trial with unit results (ASHA's paused, stopped or promoted ones): PRUNED, with every unit's metric as
  an intermediate value. That is Optuna's own picture of ASHA (its SuccessiveHalvingPruner prunes a trial that is
  not promoted at a rung), and TPE ranks pruned trials by how far they got, then by their value there; COMPLETE with
  the rung's value would rank a 1-unit loss against trials that trained 8 units;
- pending or running without results: RUNNING (TPE's constant liar steers new suggestions away from them);
- failed, or ended without a metric: FAIL (TPE ignores it).

The sampler of trial ``index`` is ``TPESampler(seed=sampler_seed(config.search_seed, index))``: a fresh sampler seeded by
``config.search_seed`` alone would draw the same first value at every plan, so each of the random start-up trials (TPE's
first ``n_startup_trials=10``) would get the same parameters. The suggestion is thus a function of the study's
results and the trial's index: the flow records it in the trial's ``trial_created`` event and a relaunch reads it
back, so a killed sweep never suggests a created trial again.

Determinism: with ``max_concurrent_trials=1`` a trial is created only when the one before it has paused or ended,
so the whole sweep is the same for the same seed, however often it is killed. With more, a new trial is created
when a slot frees, and its suggestion depends on which trials had finished by then: the recorded parameters are
kept exactly, but a second sweep with the same seed may suggest others.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState, create_trial

from training.sweep.config import SweepConfig
from training.sweep.space import Space
from training.sweep.study import Study, Trial


def distributions(space: Space) -> dict[str, BaseDistribution]:
    """The space as Optuna distributions, by key in sorted order (a ``grid`` key is refused by SweepConfig)."""
    found: dict[str, BaseDistribution] = {}
    for key in sorted(space):
        kind, values = next(iter(space[key].items()))
        if kind == "choice":
            found[key] = CategoricalDistribution(values)
        elif kind in ("uniform", "loguniform"):
            found[key] = FloatDistribution(float(values[0]), float(values[1]), log=kind == "loguniform")
        elif kind == "randint":
            found[key] = IntDistribution(values[0], values[1] - 1)  # high excluded, as in Ray Tune
        else:
            raise ValueError(f"space[{key!r}]: {kind} has no Optuna distribution; use choice or search_alg='random'")
    return found


def sampler_seed(seed: int, index: int) -> int:
    """The seed of trial ``index``'s sampler: NumPy takes 32 bits, a sweep's seed may have 63."""
    return random.Random(f"{seed}:optuna:{index}").getrandbits(32)


def suggest(study: Study, config: SweepConfig, index: int) -> dict[str, Any]:
    """Trial ``index``'s parameters (JSON: plain floats, ints and the choices' own values), from the trials before."""
    dists = distributions(config.space)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=sampler_seed(config.search_seed, index))
        direction = StudyDirection.MINIMIZE if config.mode == "min" else StudyDirection.MAXIMIZE
        search = optuna.create_study(direction=direction, sampler=sampler)
        for trial in study.by_index():
            if trial.index < index:
                search.add_trial(frozen(trial, config.metric, dists))
        asked = search.ask(dists)
    return {key: _plain(dists[key], asked.params[key]) for key in dists}


def frozen(trial: Trial, metric: str, dists: dict[str, BaseDistribution]) -> FrozenTrial:
    """One sweep trial as Optuna sees it now (see the module's docstring for the states)."""
    params = {key: trial.params[key] for key in dists}
    if trial.state == "completed":
        value = trial.metric(trial.reached, metric)
        if value is not None:
            return create_trial(params=params, distributions=dists, value=value)
    steps = {u["unit"]: v for u in trial.units if (v := trial.metric(u["unit"], metric)) is not None}
    if trial.state != "failed" and steps:
        return create_trial(state=TrialState.PRUNED, params=params, distributions=dists, intermediate_values=steps)
    state = TrialState.RUNNING if trial.state in ("pending", "running") else TrialState.FAIL
    return create_trial(state=state, params=params, distributions=dists)


def _plain(distribution: BaseDistribution, value: Any) -> Any:
    """A suggested value as the JSON type it stands for (NumPy scalars never reach the ledger)."""
    if isinstance(distribution, FloatDistribution):
        return float(value)
    if isinstance(distribution, IntDistribution):
        return int(value)
    return value
