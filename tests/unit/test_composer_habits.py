"""Composer's options as its users write them: format variables in save_folder, integer durations, save_overwrite."""

from __future__ import annotations

import logging
import os
import re

import pytest

from checkpointing import CheckpointStore
from training.config import ConfigError, TrainConfig, load_config
from training.run import Run
from training.unit.loop import run_unit


def train_to_end(config, attempt: int = 1):
    with Run.open(config, attempt=attempt) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
        return run


# -- save_folder's format variables ------------------------------------------------------------------------
def test_run_name_in_save_folder_is_substituted_and_no_folder_is_named_after_the_variable(make_config, tmp_path):
    config = make_config(run_name="exp1", save_folder=str(tmp_path / "runs" / "{run_name}"), max_duration="1ep")
    assert config.save_folder == str(tmp_path / "runs" / "exp1")
    train_to_end(config)
    assert CheckpointStore(str(tmp_path / "runs" / "exp1"), "exp1").latest() is not None
    assert os.listdir(tmp_path / "runs") == ["exp1"]  # never a folder literally named {run_name}


def test_run_name_in_save_folder_from_a_flag_or_an_environment_variable(monkeypatch):
    assert load_config(["--save_folder", "s3://b/{run_name}/ckpt", "--run_name", "x"]).save_folder == "s3://b/x/ckpt"
    monkeypatch.setenv("TRAIN_SAVE_FOLDER", "runs/{run_name}")
    monkeypatch.setenv("TRAIN_RUN_NAME", "nightly")
    assert load_config([]).save_folder == "runs/nightly"


@pytest.mark.parametrize("variable", ["rank", "local_rank", "node_rank", "world_size", "local_world_size"])
def test_a_per_process_variable_is_refused_naming_it(variable):
    with pytest.raises(ValueError, match=rf"save_folder='runs/\{{{variable}\}}': \{{{variable}\}} makes a folder per "
                                          rf"process in Composer; .* drop '\{{{variable}\}}'"):  # fmt: skip
        TrainConfig(save_folder=f"runs/{{{variable}}}")


@pytest.mark.parametrize("variable", ["epoch", "batch", "sample", "token", "total_wct"])
def test_a_position_variable_is_refused_naming_how_checkpoints_are_named(variable):
    with pytest.raises(ValueError, match=r"checkpoints/ep<epoch>-ba<step>-sa<samples>\): drop"):
        TrainConfig(save_folder=f"runs/{{{variable}}}")


# -- durations ----------------------------------------------------------------------------------------------
def test_an_integer_save_interval_or_max_duration_is_epochs_as_in_composer(tmp_path):
    config = TrainConfig(save_interval=2, max_duration=10, eval_interval=1)
    assert (config.save_interval, config.max_duration, config.eval_interval) == ("2ep", "10ep", "1ep")
    assert load_config(["--save_interval", "3", "--max_duration", "9"]).interval.value == 3
    (tmp_path / "run.yaml").write_text("save_interval: 1\nmax_duration: 4\n")
    assert load_config(["--config_file", str(tmp_path / "run.yaml")]).max_duration == "4ep"


@pytest.mark.parametrize(("value", "says"), [("0.5dur", "a fraction of the run ('dur', Composer's) is not read"),
                                             ("1000tok", "tokens ('tok', Composer's) are not counted")])  # fmt: skip
def test_composers_other_time_units_are_refused_naming_what_to_write(value, says):
    with pytest.raises(ValueError, match=rf"save_interval='{value}': {re.escape(says)}"):
        TrainConfig(save_interval=value)


# -- save_overwrite ---------------------------------------------------------------------------------------
def test_without_save_overwrite_a_launch_that_would_write_over_a_run_is_refused(make_config):
    train_to_end(make_config(max_duration="1ep"))
    store = CheckpointStore(make_config().save_folder, "r")
    before = sorted(os.listdir(store.uri))
    with pytest.raises(ConfigError, match=r"autoresume=False but run_name='r' already has checkpoints .* "
                                          r"save_overwrite=True to start it over"):  # fmt: skip
        Run.open(make_config(max_duration="1ep", autoresume=False))
    assert sorted(os.listdir(store.uri)) == before  # not even a claim


def test_save_overwrite_without_autoresume_starts_the_run_over(make_config, caplog):
    train_to_end(make_config(max_duration="2ep"))
    store = CheckpointStore(make_config().save_folder, "r")
    old = [i.name for i in store.list()]
    assert old == ["ep1-ba8-sa256", "ep2-ba16-sa512"]
    over = make_config(max_duration="1ep", autoresume=False, save_overwrite=True)
    with caplog.at_level(logging.WARNING):
        run = train_to_end(over)
    assert run.started_from == "no checkpoint" and run.units[0].origin == "fresh"
    assert [i.name for i in store.list()] == ["ep1-ba8-sa256"]  # the old run's later checkpoint is gone
    assert store.list()[0].manifest.writer.generation == run.generation  # and this one is the new run's
    assert "starts over; deleted its 2 checkpoint(s)" in caplog.text

    again = train_to_end(over, attempt=2)  # a restart of that launch continues what it trained
    assert again.started_from == "checkpoint ep1-ba8-sa256" and not again.units


def test_save_overwrite_with_autoresume_continues_and_says_it_changed_nothing(make_config, caplog):
    train_to_end(make_config(max_duration="1ep"))
    with caplog.at_level(logging.WARNING):
        run = train_to_end(make_config(max_duration="2ep", save_overwrite=True))
    assert run.started_from == "checkpoint ep1-ba8-sa256" and run.progress.epoch == 2
    assert "save_overwrite=True changes nothing here: autoresume=True continues run 'r'" in caplog.text
