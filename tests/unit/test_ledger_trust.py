"""A sweep's ledger is a claim to verify, not a fact (issue 43, items 7 and 8).

A real sweep folder: two trials of the synthetic recipe trained for real (the train flow's lifecycle, no Prefect),
their events recorded by the product's ``Ledger`` as the sweep flow records them. Then events are forged with the
same ``Ledger`` (a correct sha256: checksummed, not signed) and the sweep is opened as a relaunch opens it
(``flows.sweep.Sweep``): what it reports and what it plans to train must rest only on checkpoints that exist and
verify in each trial's own run folder; a load_path with '..' never leaves the sweep's copies.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointing import Ledger, copy_checkpoint
from checkpointing.io.storage import Storage
from flows.sweep import Sweep
from flows.sweep_report import SweepReport
from tasks.trial import SegmentOutcome, unit_checkpoints
from training.config import ConfigError, TrainConfig
from training.sweep import Study, SweepConfig, plan

SYNTHETIC = "recipes.synthetic:SyntheticRecipe"


def sweep_config(folder: Path) -> SweepConfig:
    train = TrainConfig(
        save_folder=str(folder),
        recipe=SYNTHETIC,
        recipe_args={"num_samples": 64},
        max_duration="2ep",
        save_interval="1ep",
        global_batch_size=32,
        seed=7,
        retry_delay_seconds=0,
    )
    space = {"recipe_args.lr": {"grid": [0.01, 0.1]}}
    return SweepConfig(train=train, sweep_name="sw", space=space, metric="train_loss", scheduler="fifo")


def run_like_the_flow(config: SweepConfig) -> None:
    """The sweep flow's loop, one segment at a time and in this process: each decision and each segment's units
    recorded by the product's Ledger, each trial's run trained for real (tests/lifecycle.py)."""
    from tests.lifecycle import train_to_end

    ledger = Ledger(Storage(config.sweep_folder), writer="test:flow")
    study = Study.fold(ledger.read())
    report = SweepReport(config, config.sweep_folder)

    def record(kind: str, body: dict) -> None:
        event = ledger.append(kind, body)
        study.apply(event.kind, event.body, event.seq)

    while True:
        planned = plan(study, config)
        for kind, body in planned.decisions:
            record(kind, body)
        if planned.done:
            return
        job = planned.jobs[0]
        body = {"trial": job.trial, "run_name": job.run_name, "target_units": job.target_units}
        record("segment_started", {**body, "load_path": job.load_path, "params": job.params})
        trial = config.trial_config(job.params, job.run_name, job.target_units, job.load_path)
        result = train_to_end(trial)
        outcome = SegmentOutcome(run_name=job.run_name, checkpoints=unit_checkpoints(trial),
                                 units_trained=len(result.units), started_from=result.started_from)  # fmt: skip
        units = report.units_of(outcome, trial, job.target_units)
        record("segment_finished", {**body, "status": "ok", "error": "", "units": units,
                                    "units_trained": outcome.units_trained, "started_from": ""})  # fmt: skip


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> tuple[Path, Path]:
    """A finished sweep folder (2 trials x 2 units, real checkpoints), made once, and a copy of its ledger."""
    folder = tmp_path_factory.mktemp("genuine") / "runs"
    run_like_the_flow(sweep_config(folder))
    pristine = folder.parent / "pristine-ledger"
    shutil.copytree(folder / "sw" / "sweep", pristine)
    return folder, pristine


@pytest.fixture
def folder(genuine) -> Iterator[Path]:
    """The genuine sweep folder; its ledger (the ledger names its checkpoints by where they are, so the folder
    is not copied) and anything a test put beside it are put back after each test."""
    folder, pristine = genuine
    yield folder
    shutil.rmtree(folder / "sw" / "sweep")
    shutil.copytree(pristine, folder / "sw" / "sweep")
    shutil.rmtree(folder / "elsewhere", ignore_errors=True)


def relaunch(config: SweepConfig):
    """What a relaunch of the sweep reports before it trains anything, and what it would train next."""
    opened = Sweep(config, untrusted=False)
    return opened.report.result(opened.study, opened.ledger.uri), plan(opened.study, config)


def forge(config: SweepConfig, *events: tuple[str, dict]) -> list[str]:
    """Events appended with the product's own Ledger: each has a correct sha256. Their files' URIs."""
    storage = Storage(config.sweep_folder)
    ledger = Ledger(storage, writer="forger")
    ledger.read()
    return [storage.uri(f"sweep/events/{ledger.append(kind, body).seq:08d}.json") for kind, body in events]


def a_trial_that_never_trained(config: SweepConfig, checkpoint: str, unit: dict) -> list[str]:
    """The attack of issue 43 item 7: a trial created, a segment 'finished' with train_loss 0.0 at ``checkpoint``,
    and the trial completed; its run never trained."""
    body = {"trial": "t002", "run_name": "t002", "target_units": 2}
    units = [{**unit, "unit": 2, "metrics": {"train_loss": 0.0}, "checkpoint": checkpoint}]
    return forge(
        config,
        ("trial_created", {"trial": "t002", "index": 2, "params": {"recipe_args.lr": 0.5}}),
        ("segment_started", {**body, "load_path": None, "params": {"recipe_args.lr": 0.5}}),
        (
            "segment_finished",
            {**body, "status": "ok", "error": "", "units": units, "units_trained": 2, "started_from": ""},
        ),
        ("trial_completed", {"trial": "t002"}),
    )


def test_a_genuine_sweep_reports_exactly_what_its_ledger_says(folder):
    config = sweep_config(folder)
    events = Ledger(Storage(config.sweep_folder)).read()
    unverified = SweepReport(config, config.sweep_folder).result(Study.fold(events), "ledger")
    verified, next_plan = relaunch(config)
    assert verified.summary == unverified.summary and verified.best_checkpoint == unverified.best_checkpoint
    assert verified.best_value == unverified.best_value and [t.state for t in verified.trials] == ["completed"] * 2
    assert next_plan.done and not next_plan.jobs and not next_plan.decisions  # nothing trains, nothing recorded again
    assert verified.best_checkpoint.startswith(f"{Storage(config.sweep_folder).uri()}/{verified.best_trial}/")


@pytest.mark.parametrize("where", ["outside", "dot-dot into another trial", "its own run, never written"])
def test_a_forged_unit_is_never_reported_and_its_trial_trains_again(folder, where, caplog):
    config = sweep_config(folder)
    before, _ = relaunch(config)
    t000_best = next(t for t in before.trials if t.trial == "t000").checkpoint
    name = t000_best.rsplit("/", 1)[-1]
    outside = folder / "elsewhere" / "checkpoints" / name  # a real checkpoint that verifies, but not the sweep's
    shutil.copytree(t000_best, outside)
    sweep = Storage(config.sweep_folder).uri()
    checkpoint = {
        "outside": str(outside),
        "dot-dot into another trial": f"{sweep}/t002/checkpoints/../../t000/checkpoints/{name}",
        "its own run, never written": f"{sweep}/t002/checkpoints/{name}",
    }[where]
    unit = next(u for u in before.summary["trials"][0]["units"] if u["unit"] == 2)
    files = a_trial_that_never_trained(config, checkpoint, unit)
    with caplog.at_level(logging.WARNING, logger="flows.sweep"):
        result, next_plan = relaunch(config)
    assert result.best_checkpoint == before.best_checkpoint and result.best_value == before.best_value  # (a)
    t002 = next(t for t in result.trials if t.trial == "t002")
    assert t002.state == "pending" and t002.units == 0 and t002.checkpoint is None  # (b): not completed
    assert [(j.trial, j.target_units, j.load_path) for j in next_plan.jobs] == [("t002", 2, None)]  # trained, for real
    warned = [r.getMessage() for r in caplog.records if "t002" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{files[2]}: ") and "not counted" in warned[0], warned
    assert "trains again" in warned[0] and "\n" not in warned[0]


def test_a_completed_trial_with_no_run_folder_is_not_completed(folder, caplog):
    config = sweep_config(folder)
    before, _ = relaunch(config)
    files = forge(
        config,
        ("trial_created", {"trial": "t002", "index": 2, "params": {"recipe_args.lr": 0.5}}),
        ("trial_completed", {"trial": "t002"}),
    )
    with caplog.at_level(logging.WARNING, logger="flows.sweep"):
        result, next_plan = relaunch(config)
    assert next(t.state for t in result.trials if t.trial == "t002") == "pending"
    assert [j.trial for j in next_plan.jobs] == ["t002"] and not next_plan.done
    assert result.best_checkpoint == before.best_checkpoint
    assert any(r.getMessage().startswith(f"{files[1]}: says t002 is completed") for r in caplog.records)


def test_a_forged_metric_on_a_genuine_checkpoint_is_the_manifests(folder):
    """The metric a decision reads comes from the verified checkpoint's manifest, not from the event."""
    config = sweep_config(folder)
    before, _ = relaunch(config)
    worst = max(before.trials, key=lambda t: t.value)  # the trial that lost, re-reported with train_loss 0.0
    units = [{**u, "metrics": {"train_loss": 0.0}} for u in before.summary["trials"][int(worst.trial[1:])]["units"]]
    body = {"trial": worst.trial, "run_name": worst.run_name, "target_units": 2}
    forge(config, ("segment_finished", {**body, "status": "ok", "error": "", "units": units, "units_trained": 0,
                                        "started_from": ""}))  # fmt: skip
    result, _ = relaunch(config)
    assert result.best_trial == before.best_trial and result.best_value == before.best_value > 0.0
    assert next(t for t in result.trials if t.trial == worst.trial).value == worst.value


@pytest.mark.parametrize(
    "load_path",
    [
        "{sweep}/sweep/exploits/../../../elsewhere/checkpoints/{name}",
        "{sweep}/sweep/exploits/t000-e1/checkpoints/../../../../../elsewhere/checkpoints/{name}",
        "{sweep}/sweep/exploits/t000-e1/checkpoints/{name}/../../../../t001/checkpoints/{name}",
        "{sweep}/sweep/exploits/t001-e1/checkpoints/{name}",  # another trial's copy
    ],
)
def test_a_load_path_that_leaves_the_sweeps_copies_is_refused_in_one_line(tmp_path, load_path):
    config = sweep_config(tmp_path / "runs")
    name, sweep = "ep1-ba2-sa64", Storage(config.sweep_folder).uri()
    params = {"recipe_args.lr": 0.01}
    with pytest.raises(ConfigError, match="outside its sweep's copies") as refused:
        config.trial_config(params, "t000-e1", 1, load_path=load_path.format(sweep=sweep, name=name))
    assert "\n" not in str(refused.value)
    copy = f"{sweep}/sweep/exploits/t000-e1/checkpoints/{name}"
    assert config.trial_config(params, "t000-e1", 1, load_path=copy).load_path == copy


def test_on_an_object_store_a_load_path_with_dot_dot_lies_nowhere() -> None:
    train = TrainConfig(save_folder="memory://bucket/runs", recipe=SYNTHETIC, max_duration="2ep", save_interval="1ep")
    config = SweepConfig(train=train, sweep_name="sw", space={"recipe_args.lr": {"grid": [0.01, 0.1]}})
    escape = "memory://bucket/runs/sw/sweep/exploits/../../../other/checkpoints/ep1-ba2-sa64"
    with pytest.raises(ConfigError, match="outside its sweep's copies"):
        config.trial_config({"recipe_args.lr": 0.01}, "t000-e1", 1, load_path=escape)


def test_pbt_copies_only_a_donors_own_checkpoint_and_keys_never_climb(folder) -> None:
    config = sweep_config(folder)
    opened = Sweep(config, untrusted=False)
    name = opened.study.trials["t000"].units[-1]["checkpoint"].rsplit("/", 1)[-1]
    escape = f"{opened.storage.uri()}/t000/checkpoints/../../../elsewhere/checkpoints/{name}"
    exploit = {"donor": "t000", "donor_checkpoint": escape, "run_name": "t001-e1"}
    with pytest.raises(ConfigError, match="not one of t000's own checkpoints"):
        opened._copy(exploit)
    with pytest.raises(ValueError, match="or empty segments"):
        copy_checkpoint(Storage(f"memory://{uuid.uuid4().hex}/sw"), "t000/checkpoints/../../x", "sweep/exploits/a")


def test_a_sweep_keeps_every_unit_checkpoint(tmp_path) -> None:
    """Retention would delete the checkpoints a relaunch verifies each unit by (and PBT copies, and best names)."""
    train = TrainConfig(save_folder=str(tmp_path), recipe=SYNTHETIC, max_duration="2ep", save_interval="1ep")
    space = {"recipe_args.lr": {"grid": [0.01, 0.1]}}
    with pytest.raises(ConfigError, match=r"train\.num_checkpoints_to_keep=1: a sweep keeps every unit checkpoint"):
        SweepConfig(train=train.model_copy(update={"num_checkpoints_to_keep": 1}), sweep_name="sw", space=space)
