"""What makes a relaunch the same run, compared on the values the runs really use: an argument left out of
``recipe_args`` is the recipe's default, so naming that default is the same run, and a refusal shows both values."""

from __future__ import annotations

import pytest

from training.config import ConfigError
from training.run import Run, execute_unit


def train_one_unit(config) -> None:
    with Run.open(config) as run:
        run.record(execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation))


def test_an_argument_left_out_is_the_recipes_default(make_config):
    train_one_unit(make_config(max_duration="2ep", recipe_args={"num_samples": 256}))  # hidden: the default, 32

    with pytest.raises(ConfigError) as refused:
        Run.open(make_config(max_duration="2ep", recipe_args={"num_samples": 256, "hidden": 64}))
    assert "recipe_args.hidden: 32 -> 64" in str(refused.value)  # the effective values, not None -> 64

    with Run.open(make_config(max_duration="2ep", recipe_args={"num_samples": 256, "hidden": 32})) as run:
        assert run.progress.epoch == 1  # the default named explicitly: the same run, continued


def test_the_cli_refuses_another_model_before_any_flow_run(make_config, capsys):
    from flows.cli import check_before_prefect

    train_one_unit(make_config(max_duration="2ep"))
    with pytest.raises(ConfigError, match=r"recipe_args.num_samples: 256 -> 512"):
        check_before_prefect(make_config(max_duration="2ep", recipe_args={"num_samples": 512}))
    check_before_prefect(make_config(max_duration="2ep", autoresume=False, save_overwrite=True))  # starts over: fine
