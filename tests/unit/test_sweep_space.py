"""A sweep's search space expands as Ray Tune's does, the same on every launch, and every mistake in it or in the
sweep's settings is one ConfigError that names the value and the fix; a trial's config is the base run with its
parameters set, under the sweep's folder."""

from __future__ import annotations

import random
from typing import Any

import pytest

from training.config import ConfigError, TrainConfig
from training.sweep import SweepConfig, apply, check_space, perturb, spec_differences, trial_parameters

SPACE = {
    "recipe_args.lr": {"loguniform": [1e-4, 1e-1]},
    "recipe_args.hidden": {"choice": [32, 64, 128]},
    "recipe_args.dropout": {"uniform": [0.0, 0.5]},
    "recipe_args.layers": {"randint": [1, 4]},
    "global_batch_size": {"grid": [32, 64]},
    "precision": {"grid": ["fp32", "bf16", "fp16"]},
}


def sweep(**overrides: Any) -> SweepConfig:
    values: dict[str, Any] = {
        "train": TrainConfig(save_folder="memory://sweeps", max_duration="6ep", save_interval="2ep"),
        "sweep_name": "lr-search",
        "space": SPACE,
    }
    return SweepConfig(**(values | overrides))


def test_the_grid_is_crossed_and_repeated_num_samples_times() -> None:
    trials = trial_parameters(check_space(SPACE), num_samples=3, seed=0)
    assert len(trials) == 2 * 3 * 3
    combos = [(t["global_batch_size"], t["precision"]) for t in trials]
    assert combos[:6] == [(32, "fp32"), (32, "bf16"), (32, "fp16"), (64, "fp32"), (64, "bf16"), (64, "fp16")]
    assert combos == combos[:6] * 3


def test_drawn_values_stay_inside_their_distributions() -> None:
    for t in trial_parameters(check_space(SPACE), num_samples=50, seed=1):
        assert 1e-4 <= t["recipe_args.lr"] <= 1e-1 and 0.0 <= t["recipe_args.dropout"] <= 0.5
        assert t["recipe_args.hidden"] in (32, 64, 128) and t["recipe_args.layers"] in (1, 2, 3)


def test_the_same_seed_draws_the_same_trials_whatever_order_the_space_is_written_in() -> None:
    again = dict(reversed(list(SPACE.items())))
    first = trial_parameters(check_space(SPACE), 4, seed=7)
    assert first == trial_parameters(check_space(again), 4, seed=7)
    assert first != trial_parameters(check_space(SPACE), 4, seed=8)


@pytest.mark.parametrize(
    ("space", "says"),
    [
        ({}, "give a mapping"),
        ({"run_name": {"choice": ["a"]}}, "'run_name' cannot be searched"),
        ({"recipe_args.": {"choice": [1]}}, "cannot be searched"),
        ({"recipe_args.lr": {"normal": [0, 1]}}, "give one of grid, choice"),
        ({"recipe_args.lr": {"choice": [1], "grid": [2]}}, "give one of grid, choice"),
        ({"recipe_args.lr": {"choice": []}}, "takes a list of 1 to 1000 values"),
        ({"recipe_args.lr": {"choice": [[1]]}}, "numbers, strings, booleans or null"),
        ({"recipe_args.lr": {"uniform": [1, 1]}}, "finite low < high"),
        ({"recipe_args.lr": {"uniform": [0, float("inf")]}}, "finite low < high"),
        ({"recipe_args.lr": {"loguniform": [0, 1]}}, "loguniform needs low > 0"),
        ({"recipe_args.lr": {"randint": [0.5, 3]}}, "randint takes integers"),
        ({"recipe_args.lr": {"uniform": [1, 2, 3]}}, "two numbers"),
        ({"global_batch_size": {"uniform": [16, 64]}}, "global_batch_size takes whole values"),
    ],
)
def test_a_bad_space_is_one_config_error_naming_the_key(space: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as caught:
        SweepConfig(train=TrainConfig(), sweep_name="s", space=space)
    assert len(str(caught.value).splitlines()) == 1


def test_too_many_trials_are_refused_with_the_count() -> None:
    with pytest.raises(ConfigError, match="makes 60000 trials"):
        sweep(num_samples=10_000)


@pytest.mark.parametrize(
    ("max_duration", "save_interval", "fix"),
    [("6ep", "100ba", "save_interval='1ep'"), ("7ba", "2ba", "max_duration='8ba'"), ("600sp", "1ep", "'1sp'")],
)
def test_a_budget_that_is_not_whole_units_names_both_values_and_the_fix(
    max_duration: str, save_interval: str, fix: str
) -> None:
    train = TrainConfig(max_duration=max_duration, save_interval=save_interval)
    with pytest.raises(ConfigError) as caught:
        sweep(train=train)
    assert max_duration in str(caught.value) and save_interval in str(caught.value) and fix in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"sweep_name": "../up"}, "sweep_name='../up'"),
        ({"scheduler": "hyperband"}, "scheduler="),
        ({"reduction_factor": 1}, "reduction_factor="),
        ({"quantile_fraction": 0.75}, "quantile_fraction="),
        ({"max_concurrent_trials": 0}, "max_concurrent_trials="),
        ({"typo": 1}, "typo=1: Extra inputs are not permitted"),
        ({"train": TrainConfig(resume_from="ep1-ba10-sa640", max_duration="6ep", save_interval="2ep")}, "roll"),
    ],
)
def test_a_bad_setting_is_one_config_error_naming_it(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(".", r"\.")):
        sweep(**overrides)


def test_a_trial_config_is_the_base_run_with_its_parameters_under_the_sweep_folder() -> None:
    config = sweep(train=TrainConfig(save_folder="memory://sweeps", max_duration="6ep", save_interval="2ep",
                                     recipe_args={"hidden": 8, "keep": 1}, storage_options={"anon": True}))  # fmt: skip
    params = trial_parameters(config.space, 1, 0)[0]
    trial = config.trial_config(params, "t000", target_units=2)
    assert trial.save_folder == "memory://sweeps/lr-search" and trial.run_name == "t000"
    assert trial.max_duration == "4ep" and trial.load_path is None and trial.storage_options == {"anon": True}
    assert trial.recipe_args["keep"] == 1 and trial.recipe_args["hidden"] == params["recipe_args.hidden"]
    assert trial.global_batch_size == params["global_batch_size"] and trial.precision == params["precision"]
    copy = "memory://sweeps/lr-search/sweep/exploits/t000-e1/checkpoints/ep2-ba8-sa64"  # where the sweep copies
    exploited = config.trial_config(params, "t000-e1", target_units=3, load_path=copy)
    assert exploited.load_path == copy and exploited.load_weights_only is False
    assert exploited.max_duration == "6ep" and config.units_total() == 3
    assert trial.eval_each_unit  # the schedulers compare units: each one ends with an evaluation


def test_a_base_run_with_its_own_eval_interval_keeps_it() -> None:
    config = sweep(train=TrainConfig(save_folder="memory://sweeps", max_duration="6ep", save_interval="2ep",
                                     eval_interval="1ep"))  # fmt: skip
    trial = config.trial_config(trial_parameters(config.space, 1, 0)[0], "t000", target_units=1)
    assert trial.eval_interval == "1ep" and not trial.eval_each_unit


def test_a_parameter_the_run_refuses_is_one_error_naming_the_trial() -> None:
    config = sweep(space={"eval_interval": {"choice": ["3tok"]}})
    with pytest.raises(ConfigError, match=r"the trial t000 .*eval_interval='3tok'"):
        config.trial_config({"eval_interval": "3tok"}, "t000", target_units=1)


def test_the_spec_leaves_out_what_may_change_between_launches_and_names_what_did() -> None:
    first = sweep().spec()
    assert first == sweep(max_concurrent_trials=8, trial_retries=5).spec()
    assert set(first["train"]) == {"recipe", "recipe_args", "seed", "shuffle", "save_interval", "max_duration",
                                   "global_batch_size"}  # fmt: skip
    changed = sweep(
        search_seed=1, train=TrainConfig(save_folder="memory://sweeps", max_duration="8ep", save_interval="2ep")
    )
    assert spec_differences(first, changed.spec()) == ["search_seed", "train.max_duration"]


def test_a_sweep_config_round_trips_through_json_as_a_flow_parameter_does() -> None:
    config = sweep()
    assert SweepConfig.model_validate_json(config.model_dump_json()).spec() == config.spec()


def test_explore_stays_in_the_space_and_keeps_the_grid() -> None:
    space = check_space(SPACE)
    params = trial_parameters(space, 1, 0)[0]
    rng = random.Random(0)
    for _ in range(200):
        explored = perturb(params, space, rng, resample_probability=0.3)
        assert explored["global_batch_size"] == params["global_batch_size"]
        assert explored["precision"] == params["precision"]
        assert 1e-4 <= explored["recipe_args.lr"] <= 1e-1 and explored["recipe_args.layers"] in (1, 2, 3)
        assert explored["recipe_args.hidden"] in (32, 64, 128)
    assert perturb(params, space, random.Random(5)) == perturb(params, space, random.Random(5))


def test_apply_sets_recipe_args_inside_recipe_args_and_options_at_the_top() -> None:
    fields = apply({"recipe_args": {"a": 1}, "seed": 1}, {"recipe_args.b": 2, "seed": 3})
    assert fields == {"recipe_args": {"a": 1, "b": 2}, "seed": 3}


def test_the_environment_fills_the_base_run_once_and_never_overrides_a_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAIN_SEED", "5")
    base = TrainConfig(max_duration="6ep", save_interval="2ep")
    config = sweep(train=base)
    assert config.train is base and config.train.seed == 5
    monkeypatch.setenv("TRAIN_SEED", "9")
    monkeypatch.setenv("TRAIN_GLOBAL_BATCH_SIZE", "7")
    trial = config.trial_config({"recipe_args.hidden": 32}, "t000", target_units=1)
    assert trial.seed == 5 and trial.global_batch_size == 64
    from_json = SweepConfig.model_validate({"train": {"max_duration": "6ep", "save_interval": "2ep"},
                                            "sweep_name": "s", "space": SPACE})  # fmt: skip
    assert from_json.train.seed == 9  # a flow-run parameter's base run reads the worker's variables, as train does


def test_a_trial_takes_only_what_the_space_searches_and_starts_only_from_the_sweeps_copies() -> None:
    config = sweep()
    params = trial_parameters(config.space, 1, 0)[0]
    with pytest.raises(ConfigError, match="which the space does not search"):
        config.trial_config({**params, "recipe": "evil:Recipe"}, "t000", target_units=1)  # a planted ledger event
    with pytest.raises(ConfigError, match="outside its sweep's copies"):
        config.trial_config(params, "t000-e1", target_units=1, load_path="/etc/passwd")
    copy = f"{config.sweep_folder}/sweep/exploits/t000-e1/checkpoints/ep1-ba8-sa256"
    assert config.trial_config(params, "t000-e1", target_units=1, load_path=copy).load_path == copy
