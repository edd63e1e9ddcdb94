"""Promotion rules of scheduled retraining, on a memory:// store (release.json through checkpointing.release),
and its command line."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime

import pytest
from prefect.runtime import flow_run as runtime_flow_run

from flows.retrain import decide, main, release_file, tick_run_name, warm_start
from flows.train import TrainResult
from training.config import ConfigError, TrainConfig


@pytest.fixture
def config() -> TrainConfig:
    return TrainConfig(save_folder=f"memory://retrain-{uuid.uuid4().hex}")


def result(config: TrainConfig, run_name: str, **metrics: float) -> TrainResult:
    return TrainResult(
        run_name=run_name,
        checkpoint=f"{config.save_folder}/{run_name}/checkpoints/ep1",
        epoch=1,
        step=8,
        samples_seen=256,
        sample_in_epoch=0,
        metrics=metrics,
        units=[],
        started_from="no checkpoint",
    )


def read_release(config):
    return release_file(config).read()


def promote(config, name, metric="accuracy", higher_is_better=True, **metrics):
    return decide(config, result(config, name, **metrics), read_release(config), metric, higher_is_better)


def test_first_tick_is_released_and_the_release_is_readable_back(config):
    assert read_release(config) is None
    outcome = promote(config, "t1", accuracy=0.5)

    release = read_release(config)
    assert outcome.promoted and release.run_name == "t1" and release.value == 0.5
    assert release.checkpoint == f"{config.save_folder}/t1/checkpoints/ep1"


def test_an_equal_model_is_promoted_and_a_worse_one_is_not(config):
    promote(config, "t1", accuracy=0.5)
    assert promote(config, "t2", accuracy=0.5).promoted

    outcome = promote(config, "t3", accuracy=0.4)
    assert not outcome.promoted and outcome.released_value == 0.5
    assert read_release(config).run_name == "t2"
    assert "kept the release t2" in outcome.reason


def test_a_loss_metric_is_compared_lower_is_better(config):
    promote(config, "t1", metric="loss", higher_is_better=False, loss=1.0)
    assert promote(config, "t2", metric="loss", higher_is_better=False, loss=0.8).promoted
    assert not promote(config, "t3", metric="loss", higher_is_better=False, loss=0.9).promoted
    assert read_release(config).run_name == "t2"


def test_a_metric_the_recipe_does_not_report_is_a_config_error_naming_it(config):
    with pytest.raises(ConfigError, match=r"metric='f1'.*\['accuracy', 'loss'\]"):
        promote(config, "t1", metric="f1", accuracy=0.5, loss=1.0)


def test_a_model_whose_metric_is_not_a_number_is_never_released(config):
    outcome = promote(config, "t1", accuracy=float("nan"))
    assert not outcome.promoted and "released nothing" in outcome.reason and read_release(config) is None

    promote(config, "t2", accuracy=0.5, loss=float("inf"))
    assert not promote(config, "t3", accuracy=float("nan")).promoted
    release = read_release(config)
    assert release.run_name == "t2" and release.metrics == {"accuracy": 0.5}  # the infinite loss is left out


def test_the_command_line_help_names_retrain_and_its_own_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith("usage: python -m flows.retrain")
    assert "--metric str" in out and "--higher_is_better bool" in out and "--save_folder str" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--higher_is_better", "maybe"], "error: higher_is_better='maybe'"),
        (["--metric"], "error: error parsing CLI: argument --metric: expected one argument"),
        (["--max_durration", "3ep"], "error: error parsing CLI: unrecognized arguments: --max_durration 3ep"),
        (["--seed", "x", "--metric", "loss"], "error: seed='x'"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2_as_for_train(argv, message, tmp_path, capsys):
    assert main(["--save_folder", str(tmp_path / "runs"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def tick_name(monkeypatch, flow_run_id: str, scheduled: str) -> str:
    """tick_run_name in a flow run with this id and expected start time (what prefect.runtime.flow_run reports)."""
    monkeypatch.setattr(runtime_flow_run, "id", flow_run_id, raising=False)
    monkeypatch.setattr(runtime_flow_run, "scheduled_start_time", datetime.fromisoformat(scheduled), raising=False)
    return tick_run_name("nightly")


def test_two_ticks_in_one_minute_get_runs_of_their_own_and_a_restarted_tick_keeps_its_name(monkeypatch):
    first = tick_name(monkeypatch, "1f0c2a9e-0000-4000-8000-000000000001", "2026-11-22T03:00:05+00:00")
    second = tick_name(monkeypatch, "7d41b3c0-0000-4000-8000-000000000002", "2026-11-22T03:00:40+00:00")
    restarted = tick_name(monkeypatch, "1f0c2a9e-0000-4000-8000-000000000001", "2026-11-22T03:00:05+00:00")

    assert first == "nightly-20261122T0300-1f0c2a9e" and second == "nightly-20261122T0300-7d41b3c0"
    assert restarted == first  # Prefect keeps the flow-run id and expected start time across a restart


def test_a_tick_warm_starts_from_another_runs_release_but_never_from_its_own(config):
    promote(config, "nightly-20261122T0300-1f0c2a9e", accuracy=0.5)
    release = read_release(config)

    other = warm_start(config, "nightly-20261123T0300-7d41b3c0", release)
    own = warm_start(config, "nightly-20261122T0300-1f0c2a9e", release)  # a tick restarted after it promoted itself

    assert other == {
        "run_name": "nightly-20261123T0300-7d41b3c0",
        "load_path": f"{config.save_folder}/nightly-20261122T0300-1f0c2a9e/checkpoints/ep1",
        "load_weights_only": True,
    }
    assert own == {"run_name": "nightly-20261122T0300-1f0c2a9e"}  # it resumes its run; no load_path
    assert warm_start(config, "t", None) == {"run_name": "t"}


def test_a_release_inside_the_ticks_own_run_folder_is_not_a_warm_start_either(config):
    promote(config, "renamed", accuracy=0.5)
    moved = dataclasses.replace(read_release(config), checkpoint=f"{config.save_folder}/t9/checkpoints/ep1")
    assert "load_path" not in warm_start(config, "t9", moved)
