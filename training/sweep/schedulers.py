"""Schedulers: what a sweep does next, decided from the study alone, the same whatever order trials finished in.

``plan(study, config)`` returns the decisions to record (ledger events, in order), the segments to start (in
priority order) and whether the sweep is done. It is a pure function of the study: a relaunch folds the ledger and
plans again, and since every rule reads results in trial order rather than arrival order (ASHA's rungs evaluated
prefix by prefix, PBT's generations synchronous), a sweep killed anywhere makes the decisions an uninterrupted one
makes. Segments already started are never planned again: ``unfinished_segments`` gives them to a relaunch.
With ``search_alg='optuna'`` trials are not created up front but one by one as slots free (training/sweep/
optuna_search.py suggests each from the results so far); ASHA's rung 0 still takes them in index order.

- FIFO: every trial trains its whole budget.
- ASHA (deterministic): rungs at grace_period * reduction_factor**k units below the budget, and the budget. At rung
  k, for every prefix of its entries (rung 0: trial order; rung k+1: promotion order) that all have a rung-k result,
  the top floor(len/reduction_factor) of the prefix is promoted; a promoted trial resumes its own run from its rung
  checkpoint. When nothing can run or grow, trials still waiting are stopped.
- PBT, synchronous generations (Ray Tune's ``PopulationBasedTraining(synch=True)``): every perturbation_interval
  units is a boundary that every live trial reaches before any goes on. There the trials are ranked by the metric
  (ties by index); each of the bottom quantile exploits a donor drawn from the top quantile by a generator seeded by
  (seed, generation, trial index): its next segment is a new run ``<trial>-e<n>`` started from a copy of the donor's
  checkpoint at the boundary, with the donor's parameters perturbed (``space.perturb``). Ranking reads only units at
  the boundary, which an exploit never changes, so a relaunch or another finish order draws the same exploits.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from training.sweep.config import SweepConfig
from training.sweep.space import perturb, trial_parameters
from training.sweep.study import ENDED, Study, Trial

Decision = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Job:
    """One segment to start: the run ``run_name`` of ``trial``, trained up to ``target_units``."""

    trial: str
    run_name: str
    target_units: int
    load_path: str | None
    params: dict[str, Any]


@dataclass
class Plan:
    """Decisions to record (kind, body) in order, then jobs to start in priority order while slots are free."""

    decisions: list[Decision] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    done: bool = False
    warnings: list[str] = field(default_factory=list)


def trial_name(index: int, count: int) -> str:
    """``t000``, ``t001``, ...: three digits, more when the sweep has more than 1000 trials."""
    return f"t{index:0{max(3, len(str(count - 1)))}d}"


def job_of(trial: Trial, target_units: int) -> Job:
    return Job(trial.name, trial.run_name, target_units, trial.load_path, dict(trial.params))


def unfinished_segments(study: Study) -> list[Job]:
    """Segments started and never finished (a killed sweep's): restart them first, as they were."""
    return [job_of(t, t.target_units) for t in study.running()]


def plan(study: Study, config: SweepConfig) -> Plan:
    """The next decisions and jobs of the sweep; ``study`` is left as it is."""
    study = study.copy()
    result = Plan()
    if study.spec is None:
        _decide(study, result, "sweep_started", {"sweep_name": config.sweep_name, "spec": config.spec()})
    if config.search_alg == "optuna":  # trials created one by one as slots free, the scheduler's decisions first
        _schedule(study, config, result)
        if _create_lazily(study, config, result):
            _schedule(study, config, result)
            result.warnings = list(dict.fromkeys(result.warnings))  # the second pass repeats the first's
    else:
        if not study.trials:
            every = trial_parameters(config.space, config.num_samples, config.search_seed)
            for index, params in enumerate(every):
                body = {"trial": trial_name(index, len(every)), "index": index, "params": params}
                _decide(study, result, "trial_created", body)
        _schedule(study, config, result)
    _finish(study, config, result)
    return result


def _create_lazily(study: Study, config: SweepConfig, result: Plan) -> bool:
    """search_alg='optuna': a trial suggested from the results so far while fewer than max_concurrent_trials are
    running or runnable, up to num_samples (training/sweep/optuna_search.py). Whether it created one."""
    from training.sweep.optuna_search import suggest  # optuna is an optional extra: imported when used

    created = False
    while len(study.trials) < config.num_samples:
        active = sum(1 for t in study.trials.values() if t.state in ("pending", "running"))
        if active >= config.max_concurrent_trials:
            break
        index = len(study.trials)
        body = {"trial": trial_name(index, config.num_samples), "index": index}
        _decide(study, result, "trial_created", body | {"params": suggest(study, config, index)})
        created = True
    return created


def _all_created(study: Study, config: SweepConfig) -> bool:
    """Whether no trial is left to create (search_alg='optuna' creates them as slots free)."""
    return config.search_alg != "optuna" or len(study.trials) >= config.num_samples


def _schedule(study: Study, config: SweepConfig, result: Plan) -> None:
    """The scheduler's decisions and jobs for the trials created so far."""
    if config.scheduler == "fifo":
        _fifo(study, config, result)
    elif config.scheduler == "asha":
        _asha(study, config, result)
    else:
        for kind, body in pbt_decisions(study, config, result.warnings):
            if kind == "exploit":  # recorded by the flow once the copy has landed, with "copy" added
                result.decisions.append((kind, body))
            else:
                _decide(study, result, kind, body)
        exploiting = {body["trial"] for kind, body in result.decisions if kind == "exploit"}
        result.jobs = [job_of(t, target) for t, target in pbt_jobs(study, config) if t.name not in exploiting]


def _decide(study: Study, result: Plan, kind: str, body: dict[str, Any]) -> None:
    study.apply(kind, body)
    result.decisions.append((kind, body))


def _finish(study: Study, config: SweepConfig, result: Plan) -> None:
    result.done = bool(study.trials) and _all_created(study, config)
    result.done = result.done and all(t.state in ENDED for t in study.trials.values())
    if not result.done or study.finished is not None:
        return
    best = study.best(config.metric, config.mode)
    trial, unit = best if best else (None, {})
    value = trial.metric(unit["unit"], config.metric) if trial else None
    body = {
        "best_trial": trial.name if trial else None,
        "best_run": unit.get("run_name", trial.run_name) if trial else None,
        "best_unit": unit.get("unit"),
        "best_checkpoint": unit.get("checkpoint"),
        "metric": config.metric,
        "value": value,
    }
    if trial is None:
        result.warnings.append(f"no unit of any trial reported the metric {config.metric!r}: no best trial")
    _decide(study, result, "sweep_finished", body)


# -- FIFO --------------------------------------------------------------------------------------------------------
def _fifo(study: Study, config: SweepConfig, result: Plan) -> None:
    total = config.units_total()
    for trial in study.by_index():
        if trial.state == "paused" and trial.reached >= total:
            _decide(study, result, "trial_completed", {"trial": trial.name})
    result.jobs = [job_of(t, total) for t in study.by_index() if t.state == "pending"]


# -- ASHA --------------------------------------------------------------------------------------------------------
def rungs(config: SweepConfig) -> list[int]:
    """ASHA's milestones in units: grace_period * reduction_factor**k below the budget, then the budget."""
    total, found, k = config.units_total(), [], 0
    while config.grace_period * config.reduction_factor**k < total:
        found.append(config.grace_period * config.reduction_factor**k)
        k += 1
    return [*found, total]


def rank_key(trial: Trial, unit: int, config: SweepConfig, warnings: list[str]) -> float:
    """Lower is better; a failed trial or a missing metric ranks last (and says so)."""
    value = trial.metric(unit, config.metric)
    if value is None:
        if trial.state != "failed":
            warnings.append(f"{trial.name}: no finite {config.metric!r} at unit {unit}: ranked last")
        return math.inf
    return value if config.mode == "min" else -value


def asha_promotions(study: Study, config: SweepConfig, warnings: list[str]) -> list[list[Trial]]:
    """Every rung's entries in entry order, from the results alone: rung 0 is every trial by index."""
    milestones = rungs(config)
    entries = [study.by_index()]
    for k in range(len(milestones) - 1):
        prefix = []
        for trial in entries[k]:
            if trial.unit(milestones[k]) is None and trial.state != "failed":
                break
            prefix.append(trial)
        promoted: list[Trial] = []
        keys = [rank_key(t, milestones[k], config, warnings) for t in prefix]
        for m in range(1, len(prefix) + 1):
            ranked = sorted(range(m), key=lambda i: (keys[i], i))
            top = ranked[: m // config.reduction_factor]
            promoted += [prefix[i] for i in top if prefix[i] not in promoted and prefix[i].state != "failed"]
        entries.append(promoted)
    return entries


def _asha(study: Study, config: SweepConfig, result: Plan) -> None:
    milestones = rungs(config)
    last = len(milestones) - 1
    entries = asha_promotions(study, config, result.warnings)
    for k, promoted in enumerate(entries[1:], start=1):
        for trial in promoted:
            if trial.rung < k:
                _decide(study, result, "trial_promoted", {"trial": trial.name, "rung": k})
    for trial in study.by_index():
        if trial.state == "paused" and trial.reached >= milestones[last]:
            _decide(study, result, "trial_completed", {"trial": trial.name})
        elif trial.state == "paused" and trial.paused_at != trial.rung:
            _decide(study, result, "trial_paused", {"trial": trial.name, "rung": trial.rung})
    order = {t.name: i for rung in entries for i, t in enumerate(rung)}
    waiting = [t for t in study.by_index() if t.state == "pending"]
    waiting.sort(key=lambda t: (-t.rung, order.get(t.name, t.index)))
    result.jobs = [job_of(t, milestones[t.rung]) for t in waiting]
    if not result.jobs and not study.running() and _all_created(study, config):
        for trial in study.by_index():
            if trial.state == "paused":
                reason = f"not promoted at rung {trial.rung} ({milestones[trial.rung]} units)"
                _decide(study, result, "trial_stopped", {"trial": trial.name, "reason": reason})


# -- PBT ---------------------------------------------------------------------------------------------------------
LIVE = ("pending", "running", "paused")


def boundaries(config: SweepConfig) -> list[int]:
    """The units at which generations end: every perturbation_interval below the budget, then the budget."""
    total, step = config.units_total(), config.perturbation_interval
    return [*range(step, total, step), total]


def current_generation(study: Study, config: SweepConfig) -> int:
    """The number of boundaries every live trial has reached (0: not the first yet)."""
    live = [t for t in study.by_index() if t.state in LIVE]
    low = min((t.reached for t in live), default=0)
    return sum(1 for b in boundaries(config) if b <= low)


def quantile_size(count: int, fraction: float) -> int:
    """Ray's: ceil(count * fraction), at most half of the population."""
    size = math.ceil(count * fraction)
    return math.floor(count / 2) if size > count / 2 else size


def exploits(study: Study, config: SweepConfig, generation: int, warnings: list[str]) -> list[dict[str, Any]]:
    """Every exploit of ``generation`` (1-based), recorded or not, without the copy's URI."""
    unit = boundaries(config)[generation - 1]
    ranked = [t for t in study.by_index() if t.unit(unit) is not None]
    ranked.sort(key=lambda t: (rank_key(t, unit, config, warnings), t.index))
    size = quantile_size(len(ranked), config.quantile_fraction)
    if size == 0:
        return []
    top, bottom = ranked[:size], ranked[-size:]
    found = []
    for trial in bottom:
        if trial.state == "failed":
            continue
        rng = random.Random(f"{config.search_seed}:{generation}:{trial.index}")
        donor = top[rng.randrange(len(top))]
        before = _params_at(trial, generation)
        found.append(
            {
                "trial": trial.name,
                "generation": generation,
                "unit": unit,
                "donor": donor.name,
                "donor_checkpoint": donor.unit(unit)["checkpoint"],  # type: ignore[index]
                "run_name": f"{trial.name}-e{_exploits_before(trial, generation) + 1}",
                "params_before": before,
                "params_after": perturb(_params_at(donor, generation), config.space, rng, config.resample_probability),
            }
        )
    return found


def pbt_decisions(study: Study, config: SweepConfig, warnings: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Exploits of the current generation not yet recorded, or the trials completed at the budget."""
    generation = current_generation(study, config)
    if generation == 0 or study.running():
        return []
    if generation == len(boundaries(config)):
        return [("trial_completed", {"trial": t.name}) for t in study.by_index() if t.state == "paused"]
    recorded = {(e["trial"], e["generation"]) for t in study.trials.values() for e in t.lineage}
    return [("exploit", e) for e in exploits(study, config, generation, warnings)
            if (e["trial"], generation) not in recorded]  # fmt: skip


def pbt_jobs(study: Study, config: SweepConfig) -> list[tuple[Trial, int]]:
    """Live trials behind the next boundary that are not running, with that boundary as their target."""
    marks = boundaries(config)
    generation = current_generation(study, config)
    if generation == len(marks):
        return []
    target = marks[generation]
    return [(t, target) for t in study.by_index() if t.state in ("pending", "paused") and t.reached < target]


def _exploits_before(trial: Trial, generation: int) -> int:
    return sum(1 for e in trial.lineage if e["generation"] < generation)


def _params_at(trial: Trial, generation: int) -> dict[str, Any]:
    """The trial's parameters during the generation that just ended (before any exploit of ``generation``)."""
    later = [e for e in trial.lineage if e["generation"] >= generation]
    return dict(later[0]["params_before"]) if later else dict(trial.params)
