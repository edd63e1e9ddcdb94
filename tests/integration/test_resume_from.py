"""Roll-backs (through the train flow, whose logs say what was set aside), a bad resume_from, load_path on a run
that has checkpoints, and best checkpoints (through the run's lifecycle, ``train_run``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from checkpointing import CheckpointStore
from flows.train import train
from training.config import ConfigError


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")
def test_resume_from_rolls_back_once_and_keeps_the_later_checkpoints_as_a_record(make_config, tmp_path, caplog):
    first = train(make_config(max_duration="4ep"))
    names = [u.checkpoint_name for u in first.units]
    assert len(names) == 4

    caplog.set_level(logging.INFO, logger="prefect.flow_runs")
    back = train(make_config(max_duration="4ep", resume_from=names[1]))

    said = [r.getMessage() for r in caplog.records if "stop being candidates" in r.getMessage()]
    assert len(said) == 1 and f"checkpoints that stop being candidates: {names[2]}, {names[3]} (kept in" in said[0]

    assert [u.unit for u in back.units] == [2, 3]
    assert (back.units[0].origin, back.units[0].resumed_from) == ("store", f"checkpoint {names[1]}")
    assert (back.epoch, back.step, back.samples_seen) == (4, 32, 4 * 256)
    assert back.checkpoint_name not in names  # retrained under a new name; the old ep4 is not overwritten
    store = CheckpointStore(make_config().save_folder, "r")
    for name in names[2:]:
        assert (tmp_path / "runs" / "r" / "checkpoints" / name / "manifest.json").is_file()
        assert store.check(name, deep=True) == []
    candidates = [i.name for i in store.candidates()]
    assert candidates[0] == back.checkpoint_name
    assert not set(names[2:]) & set(candidates)
    assert store.set_aside() == names[2:]

    # launched again with the same resume_from (as a restarted flow run is): continues from the newest
    again = train(make_config(max_duration="5ep", resume_from=names[1]))

    assert [u.unit for u in again.units] == [4]
    assert again.started_from == f"checkpoint {back.checkpoint_name}"
    assert (again.epoch, again.samples_seen) == (5, 5 * 256)
    assert len(store.rollbacks()) == 1
    assert back.checkpoint_name in [i.name for i in store.candidates()]


def test_resume_from_a_name_the_run_does_not_have_fails_and_writes_nothing(make_config, tmp_path, train_run):
    run = tmp_path / "runs" / "r"
    with pytest.raises(ConfigError, match=r"^resume_from='ep1-ba8-sa256': run 'r' in .* has no checkpoint"):
        train_run(make_config(resume_from="ep1-ba8-sa256"))
    assert not run.exists()

    train_run(make_config(max_duration="1ep"))
    before = files_under(run)
    with pytest.raises(ConfigError, match=r"^resume_from='ep9': run 'r' in .* \(its newest: ep1-ba8-sa256;"):
        train_run(make_config(max_duration="2ep", resume_from="ep9"))
    assert files_under(run) == before  # no new claims/ file, no roll-back record, latest untouched


def test_load_path_on_a_run_that_has_checkpoints_is_ignored_with_a_warning(make_config, train_run):
    source = train_run(make_config(run_name="source", max_duration="1ep"))
    tuned = dict(run_name="tuned", load_path=source.checkpoint, load_weights_only=True)
    first = train_run(make_config(max_duration="1ep", **tuned))
    assert first.warnings == []

    again = train_run(make_config(max_duration="2ep", **tuned))

    assert again.units[0].resumed_from.startswith(f"checkpoint {first.checkpoint_name}")  # not load_path
    assert again.warnings == [
        f"load_path={source.checkpoint!r} is ignored: run 'tuned' already has checkpoints and resumes from its "
        f"checkpoint {first.checkpoint_name}. To start from load_path, choose a new run_name; to go back to an "
        f"earlier checkpoint of this run, set resume_from=<checkpoint name> (python -m checkpointing ls "
        f"{again.store})"
    ]


def test_best_checkpoints_are_ordered_by_the_score_attribute(make_config, train_run):
    lowest = train_run(make_config(checkpoint_score_attribute="train_loss", checkpoint_score_order="min"))

    by_loss = sorted(lowest.units, key=lambda u: u.metrics["train_loss"])
    assert lowest.best_checkpoint_names == [u.checkpoint_name for u in by_loss]
    assert lowest.best_checkpoints == [u.checkpoint for u in by_loss]
    pairs = [(checkpoint, metrics["train_loss"]) for checkpoint, metrics in lowest.best_checkpoints_with_metrics]
    assert pairs == [(u.checkpoint, u.metrics["train_loss"]) for u in by_loss]  # Ray's (checkpoint, metrics) shape
    again = type(lowest).model_validate_json(lowest.model_dump_json())  # as a Prefect result stores it
    assert again.best_checkpoints_with_metrics == lowest.best_checkpoints_with_metrics
    assert again.best_checkpoints_with_metrics[0].checkpoint == lowest.best_checkpoints[0]
    highest = train_run(
        make_config(checkpoint_score_attribute="train_loss", checkpoint_score_order="max")
    )  # trains nothing
    assert highest.units == [] and highest.best_checkpoint_names == lowest.best_checkpoint_names[::-1]
    assert train_run(make_config()).best_checkpoints == []
