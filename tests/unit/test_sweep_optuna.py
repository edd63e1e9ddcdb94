"""search_alg='optuna': Optuna's TPE suggests each new trial from the results so far, the ledger keeps what it
suggested, so a sweep with one slot is the same every time, killed or not; TPE's later trials close in on the
optimum where a seeded random search does not; a relaunch never changes a created trial; what cannot work is one
ConfigError."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from tests.unit.test_sweep_schedulers import FakeTrainer, Sweep, sweep_config
from training.config import ConfigError, TrainConfig
from training.sweep import Job, Study, SweepConfig, plan
from training.sweep.optuna_search import distributions, frozen, sampler_seed

SPACE = {"recipe_args.lr": {"loguniform": [1e-4, 1e-1]}, "recipe_args.width": {"choice": [1, 2]}}
OPTIMUM = 1.3


def optuna_config(scheduler: str = "fifo", **overrides: Any) -> SweepConfig:
    values = {"space": SPACE, "search_alg": "optuna", "num_samples": 12, "max_concurrent_trials": 1}
    return sweep_config(scheduler, **(values | overrides))


def created(sweep: Sweep) -> dict[str, dict[str, Any]]:
    """Every trial_created event's params by trial, checking that no trial was created twice."""
    bodies = [e.body for e in sweep.events if e.kind == "trial_created"]
    assert len({b["trial"] for b in bodies}) == len(bodies)
    return {b["trial"]: b["params"] for b in bodies}


class QuadraticTrainer(FakeTrainer):
    """Every unit reports (x - OPTIMUM)**2: a 1-D objective with its optimum inside the space."""

    @staticmethod
    def gain(params: dict[str, Any]) -> float:
        return 1.0

    def finish(self, job: Job) -> dict[str, Any]:
        body = super().finish(job)
        for unit in body["units"]:
            unit["metrics"] = {"loss": (job.params["recipe_args.x"] - OPTIMUM) ** 2}
        return body


def distances(search_alg: str, seed: int) -> list[float]:
    """|x - OPTIMUM| of 20 trials in creation order, one at a time, each trained 1 unit."""
    train = TrainConfig(save_folder="memory://sweeps", max_duration="1ba", save_interval="1ba")
    space = {"recipe_args.x": {"uniform": [-5.0, 5.0]}}
    config = optuna_config(train=train, space=space, search_alg=search_alg, num_samples=20, search_seed=seed)
    study = Sweep(config, QuadraticTrainer()).run(random.Random(0), slots=1)
    return [abs(t.params["recipe_args.x"] - OPTIMUM) for t in study.by_index()]


def test_the_space_maps_to_optunas_distributions_with_randint_high_excluded() -> None:
    space = {
        "recipe_args.a": {"choice": [None, "x", 1.5, True]},
        "recipe_args.b": {"uniform": [0, 1]},
        "recipe_args.c": {"loguniform": [1e-4, 1e-1]},
        "recipe_args.d": {"randint": [1, 4]},
    }
    assert distributions(space) == {
        "recipe_args.a": CategoricalDistribution([None, "x", 1.5, True]),
        "recipe_args.b": FloatDistribution(0.0, 1.0),
        "recipe_args.c": FloatDistribution(1e-4, 1e-1, log=True),
        "recipe_args.d": IntDistribution(1, 3),
    }


def test_the_first_plan_creates_only_as_many_trials_as_may_run_at_once() -> None:
    first = plan(Study(), optuna_config(max_concurrent_trials=3))
    assert [kind for kind, _ in first.decisions] == ["sweep_started"] + ["trial_created"] * 3
    assert [job.run_name for job in first.jobs] == ["t000", "t001", "t002"] and not first.done


@pytest.mark.parametrize("scheduler", ["fifo", "asha"])
def test_an_optuna_sweep_with_one_slot_is_the_same_every_time_and_finishes(scheduler: str) -> None:
    config = optuna_config(scheduler)
    first, again = (Sweep(config).run(random.Random(seed), slots=1) for seed in (0, 1))
    assert first.summary() == again.summary()
    assert len(first.trials) == 12 and first.finished is not None
    assert {t.state for t in first.trials.values()} <= {"completed", "stopped"}


@pytest.mark.parametrize("scheduler", ["fifo", "asha"])
def test_an_optuna_sweep_killed_and_relaunched_with_one_slot_makes_the_same_sweep(scheduler: str) -> None:
    config = optuna_config(scheduler)
    clean = Sweep(config)
    reference = clean.run(random.Random(0), slots=1)
    for seed in range(4):
        rng, sweep = random.Random(seed), Sweep(config)
        for _ in range(5):
            sweep.run(rng, slots=1, kill_after=len(sweep.events) + rng.randint(1, 15))
        assert sweep.run(rng, slots=1).summary() == reference.summary()
        assert sweep.trainer.units_trained == clean.trainer.units_trained


def test_asha_with_optuna_enters_new_trials_at_rung_0_in_index_order() -> None:
    sweep = Sweep(optuna_config("asha"))
    sweep.run(random.Random(0), slots=1)
    first_segments = [
        e.body["trial"] for e in sweep.events if e.kind == "segment_started" and e.body["target_units"] == 1
    ]
    assert first_segments == [f"t{i:03d}" for i in range(12)]
    assert any(e.kind == "trial_promoted" for e in sweep.events)
    assert any(e.kind == "trial_stopped" for e in sweep.events)


@pytest.mark.parametrize("scheduler", ["fifo", "asha"])
def test_a_relaunch_with_two_slots_never_changes_or_repeats_a_created_trial(scheduler: str) -> None:
    config = optuna_config(scheduler, max_concurrent_trials=2)
    for seed in range(4):
        rng, sweep = random.Random(seed), Sweep(config)
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(6):
            sweep.run(rng, slots=2, kill_after=len(sweep.events) + rng.randint(1, 12))
            now = created(sweep)
            assert {name: now[name] for name in seen} == seen
            seen = now
        study = sweep.run(rng, slots=2)
        assert {t.name: t.params for t in study.by_index()} == created(sweep) and len(study.trials) == 12
        seen = created(sweep)
        for event in sweep.events:
            if event.kind == "segment_started":
                assert event.body["params"] == seen[event.body["trial"]]
        assert all(json.loads(json.dumps(p)) == p for p in seen.values())
        assert all(type(p["recipe_args.lr"]) is float and type(p["recipe_args.width"]) is int for p in seen.values())


def test_tpe_closes_in_on_the_optimum_where_a_random_search_with_the_same_seed_does_not() -> None:
    tpe, uniform = distances("optuna", seed=0), distances("random", seed=0)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(tpe[10:]) < mean(tpe[:10])  # TPE starts after 10 random trials (n_startup_trials)
    assert mean(uniform[10:]) >= mean(uniform[:10])


def test_each_trial_index_has_a_sampler_seed_of_its_own_that_numpy_takes() -> None:
    seeds = {sampler_seed(2**63 - 1, index) for index in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**32 for s in seeds)
    assert sampler_seed(7, 3) == sampler_seed(7, 3) != sampler_seed(8, 3)


def test_optuna_sees_a_completed_trial_complete_an_asha_trial_pruned_at_its_units_the_rest_running_or_failed() -> None:
    sweep = Sweep(optuna_config("asha", num_samples=6, max_concurrent_trials=2))
    study = sweep.run(random.Random(0), slots=2)
    dists = distributions(SPACE)
    for trial in study.by_index():
        seen = frozen(trial, "loss", dists)
        if trial.state == "completed":
            assert seen.state == TrialState.COMPLETE and seen.value == trial.metric(trial.reached, "loss")
        else:
            assert seen.state == TrialState.PRUNED
            assert seen.intermediate_values == {u["unit"]: u["metrics"]["loss"] for u in trial.units}
    fresh = Study.fold(sweep.events[:3])
    assert [frozen(t, "loss", dists).state for t in fresh.by_index()] == [TrialState.RUNNING] * 2
    fresh.trials["t000"].state = "failed"
    assert frozen(fresh.trials["t000"], "loss", dists).state == TrialState.FAIL


def test_importing_the_sweep_package_or_a_random_sweep_never_imports_optuna() -> None:
    code = (
        "import sys; from training.sweep import Study, plan; from tests.unit.test_sweep_schedulers import sweep_config;"
        "plan(Study(), sweep_config('asha')); assert 'optuna' not in sys.modules, 'optuna imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"space": {"recipe_args.width": {"grid": [1, 2]}}}, "grid at recipe_args.width"),
        ({"scheduler": "pbt"}, "scheduler='pbt'"),
    ],
)
def test_what_optuna_cannot_do_is_one_config_error_with_its_fix(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        optuna_config(**({"scheduler": "fifo"} | overrides))
    message = str(caught.value)
    assert named in message and "search_alg='random'" in message and len(message.splitlines()) == 1


def test_a_missing_optuna_package_is_a_config_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else find(name, *a))
    with pytest.raises(ConfigError, match=r"resumable-train\[optuna\]"):
        optuna_config()
