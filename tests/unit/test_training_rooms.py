"""The typed values issue 47's rooms gave the loop: a unit's running figures (what a checkpoint inside a unit records
and a resumed unit reads back, typed or not at all) and durations parsed once. Behaviour through whole runs is covered
by test_host_tier.py (a resumed unit reports the whole unit's figures) and test_preemption.py."""

from __future__ import annotations

import ast
import math

import pytest

from training.config.durations import Duration
from training.unit.figures import AttemptFigures, UnitFigures


def test_a_units_figures_survive_the_manifests_round_trip_and_a_copy_is_not_changed_by_later_steps():
    figures = UnitFigures(unit_start_samples=64)
    figures.add_step(2.0, grad_norm=1.0)
    figures.add_step(1.0, grad_norm=None)  # a step whose recipe reports no gradient norm
    figures.evaluated = {"eval_loss": 0.5, "eval_step": 2.0}
    taken = figures.copy()
    figures.add_step(9.0, grad_norm=3.0)
    figures.evaluated["eval_loss"] = 7.0
    assert (taken.loss_sum, taken.loss_count, taken.norm_sum, taken.norm_count) == (3.0, 2, 1.0, 1)
    assert taken.evaluated == {"eval_loss": 0.5, "eval_step": 2.0} and taken.train_loss == 1.5
    assert UnitFigures.from_record(taken.record()) == taken


@pytest.mark.parametrize(
    "damage",
    [
        {"loss_count": True},  # a bool is not a count
        {"loss_sum": math.inf},
        {"snapshots": "3"},
        {"evaluated": {"eval_loss": "low"}},
        {"evaluated": [1.0]},
    ],
)
def test_a_record_that_does_not_read_as_figures_is_ignored_whole(damage):
    record = {**UnitFigures(unit_start_samples=0, loss_sum=1.0, loss_count=1).record(), **damage}
    assert UnitFigures.from_record(record) is None
    assert UnitFigures.from_record("not a record") is None
    assert UnitFigures.from_record({k: v for k, v in record.items() if k != "norm_sum"}) is None


def test_the_units_metrics_cover_the_whole_unit_and_the_speed_this_attempt():
    figures = UnitFigures(unit_start_samples=0, loss_sum=4.0, loss_count=2, snapshots=1)  # two steps before a resume
    attempt = AttemptFigures(start_samples=64)
    attempt.step(1.0)
    attempt.stalls.append(0.25)
    figures.add_step(1.0, None)
    metrics = attempt.metrics(figures, samples_seen=96)
    assert metrics["train_loss"] == 5.0 / 3 and metrics["samples"] == 96.0 and attempt.steps == 1
    assert metrics["snapshots"] == 1.0 and metrics["snapshot_seconds_max"] == 0.25 and "grad_norm" not in metrics


def test_durations_are_parsed_once_and_a_copy_with_another_duration_reads_its_own(make_config):
    config = make_config(max_duration="3ep", save_interval="2ba", snapshot_interval="1ba", eval_interval="1ep")
    assert config.duration is config.duration and config.interval is config.interval  # one value, not a parse a read
    assert config.snapshot_every is config.snapshot_every and config.eval_every is config.eval_every
    assert config.duration == Duration(3, "ep") and config.snapshot_every == Duration(1, "ba")
    longer = config.model_copy(update={"max_duration": "5ep"})  # flows/retrain.py copies configs this way
    assert longer.duration == Duration(5, "ep") and config.duration == Duration(3, "ep")
    with pytest.raises(ValueError, match=r"save_interval='3tok': tokens"):
        Duration.parse("3tok", "save_interval")


def test_the_orchestrator_state_names_are_spelled_in_one_module():
    """A name spelled twice drifts: the reconciler once set a name flows/restarts.py no longer read."""
    from tests.conftest import ROOT
    from training import run_states

    names = {run_states.PREEMPTED, run_states.SUPERSEDED, run_states.AWAITING_RESTART, run_states.ATTEMPT_DIED}
    literals = names | {run_states.flow_run_event(n) for n in names}
    # the exception class Preempted (training.preemption), not a state: a rank's error record, flows.train's __all__
    not_a_state = {("training/distributed/errors.py", "Preempted"), ("flows/train.py", "Preempted")}
    spelled = set()
    for package in ("checkpointing", "training", "tasks", "flows", "deployments", "recipes"):
        for path in (ROOT / package).rglob("*.py"):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in literals and (where, node.value) not in not_a_state:
                    spelled.add(where)
    assert spelled == {"training/run_states.py"}
