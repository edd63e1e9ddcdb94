"""Promotion rules of scheduled retraining, on a memory:// store (release.json goes through the storage layer)."""

from __future__ import annotations

import logging
import uuid

import pytest

from flows.retrain import decide, read_release
from flows.train import TrainResult
from training.config import ConfigError, TrainConfig

log = logging.getLogger("test")


@pytest.fixture
def config() -> TrainConfig:
    return TrainConfig(save_folder=f"memory://retrain-{uuid.uuid4().hex}")


def result(run_name: str, **metrics: float) -> TrainResult:
    return TrainResult(
        run_name=run_name,
        checkpoint=f"memory://x/{run_name}/checkpoints/ep1",
        epoch=1,
        step=8,
        samples_seen=256,
        sample_in_epoch=0,
        metrics=metrics,
        units=[],
        started_from="no checkpoint",
    )


def promote(config, name, metric="accuracy", higher_is_better=True, **metrics):
    return decide(config, result(name, **metrics), read_release(config), metric, higher_is_better, log)


def test_first_tick_is_released_and_the_release_is_readable_back(config):
    assert read_release(config) is None
    outcome = promote(config, "t1", accuracy=0.5)

    release = read_release(config)
    assert outcome.promoted and release.run_name == "t1" and release.value == 0.5
    assert release.checkpoint == "memory://x/t1/checkpoints/ep1"


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
