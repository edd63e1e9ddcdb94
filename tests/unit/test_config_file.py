"""Config files as MindSpore users write them: nested sections are refused with their flat equivalent; the new
interop options validate at the edge."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tests.conftest import ROOT
from training.config import ConfigError, TrainConfig, describe_error, load_config

MINDSPORE_YAML = """\
seed: 3
runner_config:
  epochs: 3
  batch_size: 32
  sink_size: 2
trainer:
  ignore_data_skip: true
callbacks:
  - type: CheckpointMonitor
    prefix: llama2_7b
    save_checkpoint_steps: 500
    keep_checkpoint_max: 3
recipe_args:
  hidden: 8
"""


def test_nested_mindspore_yaml_is_refused_with_the_flat_equivalent(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(MINDSPORE_YAML)
    with pytest.raises(ConfigError) as info:
        load_config(["--config_file", str(path)])
    assert str(info.value) == (
        f"config_file={str(path)!r}: nested sections are not read; TrainConfig is flat. Recognised: "
        "runner_config.epochs -> max_duration: '3ep', runner_config.batch_size -> global_batch_size: 32, "
        "trainer.ignore_data_skip -> ignore_data_skip: true, "
        "callbacks.CheckpointMonitor.save_checkpoint_steps -> save_interval: '500ba', "
        "callbacks.CheckpointMonitor.keep_checkpoint_max -> num_checkpoints_to_keep: 3; "
        "unknown: runner_config.sink_size, callbacks.CheckpointMonitor.prefix. "
        "Write the recognised keys at the top level (python -m flows.train --help lists every field)"
    )


def test_the_flat_equivalent_it_prints_is_a_file_that_loads(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text(
        "seed: 3\nmax_duration: '3ep'\nglobal_batch_size: 32\nignore_data_skip: true\nsave_interval: '500ba'\n"
        "num_checkpoints_to_keep: 3\nrecipe_args:\n  hidden: 8\n"
    )
    config = load_config(["--config_file", str(flat)])
    assert (config.max_duration, config.global_batch_size, config.save_interval) == ("3ep", 32, "500ba")
    assert config.recipe_args == {"hidden": 8} and config.num_checkpoints_to_keep == 3


def test_a_toml_table_is_a_nested_section_too(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[checkpoint_config]\nsave_checkpoint_steps = 100\nload_checkpoint = "s3://b/ckpt"\n')
    with pytest.raises(ConfigError) as info:
        load_config(["--config_file", str(path)])
    assert (
        "Recognised: checkpoint_config.save_checkpoint_steps -> save_interval: '100ba', "
        "checkpoint_config.load_checkpoint -> load_path: 's3://b/ckpt'; unknown: none." in str(info.value)
    )


def test_the_cli_prints_the_flat_equivalent_and_exits_2_writing_nothing(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(MINDSPORE_YAML)
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "--config_file", str(path), "--save_folder", str(tmp_path / "runs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: config_file={str(path)!r}: nested sections are not read")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "values, expected",
    [
        (
            {"export_on_complete": "/home/me/.bashrc"},
            "export_on_complete='/home/me/.bashrc': name a .pt, .pth or .safetensors file, e.g. s3://b/model.pt",
        ),
        (
            {"load_ignore_keys": ["fc.*"]},
            "load_strict and load_ignore_keys apply to load_path: set load_path, or leave them out",
        ),
    ],
)
def test_interop_options_are_validated_at_the_edge(values, expected):
    with pytest.raises(ValidationError) as info:
        TrainConfig(**values)
    assert describe_error(info.value) == expected


def test_load_ignore_keys_come_from_flags_and_environment_as_json_lists(monkeypatch):
    config = load_config(["--load_path", "w.pt", "--load_ignore_keys", '["3.*", "head.*"]', "--load_strict", "false"])
    assert config.load_ignore_keys == ["3.*", "head.*"] and config.load_strict is False
    monkeypatch.setenv("TRAIN_LOAD_IGNORE_KEYS", '["fc.*"]')
    assert load_config(["--load_path", "w.pt"]).load_ignore_keys == ["fc.*"]
