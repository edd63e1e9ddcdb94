"""TrainConfig: flags, TRAIN_* variables and config files map onto one validated settings class."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tests.conftest import ROOT
from training.config import Duration, TrainConfig, describe_error, load_config


def test_flags_environment_and_file_fill_one_config_with_flags_winning(tmp_path, monkeypatch):
    cfg = tmp_path / "run.toml"
    cfg.write_text('run_name = "from-file"\nseed = 3\nglobal_batch_size = 16\n')
    monkeypatch.setenv("TRAIN_SEED", "5")
    monkeypatch.setenv("TRAIN_RECIPE_ARGS", '{"hidden": 64}')
    config = load_config(["--config_file", str(cfg), "--global_batch_size", "48"])

    assert config.run_name == "from-file"  # file
    assert config.seed == 5  # environment beats file
    assert config.global_batch_size == 48  # flag beats file
    assert config.recipe_args == {"hidden": 64}


def test_yaml_config_file_is_read(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_duration: 7ba\nsave_interval: 2ba\n")
    config = load_config(["--config_file", str(cfg)])
    assert (config.duration, config.interval) == (Duration(7, "ba"), Duration(2, "ba"))


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("save_interval", "3x", "save_interval='3x': use '<n>ep' (epochs), '<n>ba' (batches) or '<n>sp' (samples)"),
        ("max_duration", "ep", "max_duration='ep'"),
        ("run_name", "a/b", "run_name='a/b': use 1-128 letters"),
        ("run_name", "/etc", "run_name='/etc'"),
        ("recipe", "no colon", "recipe='no colon': use a registered recipe name (e.g. 'digits') or an import path"),
        ("num_checkpoints_to_keep", -3, "num_checkpoints_to_keep=-3"),
    ],
)
def test_invalid_values_name_the_field_the_value_and_what_is_accepted(field, value, expected):
    with pytest.raises(ValidationError) as info:
        TrainConfig(**{field: value})
    assert expected in describe_error(info.value)


def test_storage_options_are_neither_echoed_nor_serialized():
    secret = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}
    config = TrainConfig(storage_options=secret)
    assert config.storage_options == secret
    assert "s3cr3t-value" not in repr(config)
    assert "s3cr3t-value" not in config.model_dump_json()
    with pytest.raises(ValidationError) as info:
        TrainConfig(storage_options="s3cr3t-value")
    assert "s3cr3t-value" not in describe_error(info.value)


def test_help_lists_every_field_with_its_description():
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for name, field in TrainConfig.model_fields.items():
        assert f"--{name}" in proc.stdout
        assert field.description.split()[0] in proc.stdout


def test_fingerprint_ignores_durations_and_batch_size_but_not_the_model():
    base = TrainConfig()
    assert base.fingerprint() == TrainConfig(max_duration="9ep", global_batch_size=3).fingerprint()
    assert base.fingerprint() != TrainConfig(recipe_args={"hidden": 8}).fingerprint()
