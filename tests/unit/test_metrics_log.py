"""Metrics where people look (training/metrics/log.py): TensorBoard event files read back as TensorBoard reads
them, a retried unit's steps replaced rather than duplicated, the progress bar only on a terminal, a metrics backend
that is down never failing training, and bad options refused in one line."""

from __future__ import annotations

import json
import logging
import os
import pty
from pathlib import Path

import pytest
from pydantic import ValidationError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from training.config import describe_error
from training.exceptions import InjectedFault
from training.metrics import log as metrics_log
from training.metrics.log import wants_progress_bar
from training.unit.loop import run_unit


@pytest.fixture(autouse=True)
def _closed_writers():
    yield
    metrics_log.close_all()


def scalars(folder: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    """The series as TensorBoard shows it (purges applied)."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def purge_steps(folder: Path) -> list[int]:
    """The steps of the restart records (SessionLog START) in the event files, oldest file first."""
    found = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                found.append(event.step)
    return found


def assert_one_curve(series: list[tuple[int, float]], steps: int) -> None:
    assert [s for s, _ in series] == list(range(1, steps + 1))  # each step once, strictly increasing


def test_a_run_writes_each_step_once_beside_the_run_with_unit_metrics(make_config, train_run, tmp_path):
    config = make_config(max_duration="2ep", eval_each_unit=True)
    train_run(config)
    metrics_log.close_all()
    folder = tmp_path / "runs" / "r" / "tb"
    assert_one_curve(scalars(folder), 16)
    assert_one_curve(scalars(folder, "train/lr"), 16)
    assert [s for s, _ in scalars(folder, "unit/train_loss")] == [8, 16]
    assert [s for s, _ in scalars(folder, "eval/loss")] == [8, 16]


def test_the_final_evaluation_of_a_run_reaches_its_curves_at_the_last_step(make_config, train_run, tmp_path):
    result = train_run(make_config(max_duration="2ep"))  # no evaluation inside the run: one at its end
    metrics_log.close_all()
    final = scalars(tmp_path / "runs" / "r" / "tb", "eval/loss")
    assert final == [(16, pytest.approx(result.metrics["eval_loss"]))]
    assert_one_curve(scalars(tmp_path / "runs" / "r" / "tb"), 16)  # the evaluation's writer purged nothing


def test_a_retried_unit_replaces_the_steps_its_failed_attempt_logged(make_config, tmp_path):
    reference = make_config(run_name="reference", max_duration="2ep", log_every_n_steps=1)
    for _ in range(2):
        run_unit(reference)
    config = make_config(max_duration="2ep", inject_fault_at_step=12, log_every_n_steps=1)
    run_unit(config)
    with pytest.raises(InjectedFault):
        run_unit(config)  # attempt 1 of unit 1 logged steps 9-12, then failed: its retry resumes at step 8
    run_unit(config, attempt=2)
    metrics_log.close_all()
    folder = tmp_path / "runs" / "r" / "tb"
    assert purge_steps(folder) == [1, 9]  # the retry's file tells readers to drop what came after step 8
    assert scalars(folder) == scalars(tmp_path / "runs" / "reference" / "tb")
    assert_one_curve(scalars(folder), 16)


def test_metrics_dir_holds_one_folder_per_run(make_config, train_run, tmp_path):
    train_run(make_config(max_duration="1ep", metrics_dir=str(tmp_path / "tb")))
    metrics_log.close_all()
    assert_one_curve(scalars(tmp_path / "tb" / "r"), 8)
    assert not (tmp_path / "runs" / "r" / "tb").exists()


def test_tensorboard_false_writes_no_event_files(make_config, train_run, tmp_path):
    train_run(make_config(max_duration="1ep", tensorboard=False))
    assert not (tmp_path / "runs" / "r" / "tb").exists()


def test_a_metrics_backend_that_is_down_warns_once_and_training_completes(
    make_config, train_run, tmp_path, monkeypatch, caplog
):
    (tmp_path / "not-a-folder").write_text("a file where the event files should go")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the discard port: nothing answers
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with caplog.at_level(logging.WARNING, logger="training.unit"):
        result = train_run(make_config(max_duration="2ep", metrics_dir=str(tmp_path / "not-a-folder")))
    assert result.step == 16
    warnings = [r.getMessage() for r in caplog.records if "metrics are off" in r.getMessage()]
    assert len([w for w in warnings if w.startswith("TensorBoard")]) == 1, warnings
    assert len([w for w in warnings if w.startswith("MLflow")]) == 1, warnings


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("metrics_dir", "s3://bucket/tb", "metrics_dir='s3://bucket/tb': TensorBoard event files go to a local folder"),
        ("metrics_dir", "", "metrics_dir='': TensorBoard event files go to a local folder"),
        ("mlflow_experiment", "", "mlflow_experiment='': use a name of 1 to 500 printable characters"),
    ],
)
def test_bad_metrics_options_are_refused_in_one_line_naming_option_and_value(make_config, option, value, words):
    with pytest.raises(ValidationError) as info:
        make_config(**{option: value})
    text = describe_error(info.value)
    assert text.startswith(words) and "\n" not in text


def test_the_progress_bar_is_only_for_a_terminal(make_config, monkeypatch):
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    primary, replica = pty.openpty()
    read_end, write_end = os.pipe()
    with os.fdopen(replica, "w") as tty, os.fdopen(write_end, "w") as pipe:
        assert wants_progress_bar(make_config(), tty, tty)
        assert not wants_progress_bar(make_config(progress_bar=False), tty, tty)
        assert not wants_progress_bar(make_config(), pipe, tty)  # stdout redirected
        assert not wants_progress_bar(make_config(), tty, pipe)  # stderr redirected
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "a-worker-started-this")
        assert not wants_progress_bar(make_config(), tty, tty)
    os.close(primary)
    os.close(read_end)


def test_a_loop_of_your_own_writes_its_reports(make_config, train_run, tmp_path):
    config = make_config(
        recipe="recipes.custom_loop:CustomLoopRecipe", recipe_args={"num_samples": 64}, max_duration="16ba"
    )
    train_run(config)
    metrics_log.close_all()
    series = scalars(tmp_path / "runs" / "r" / "tb", "report/train_loss")
    assert [s for s, _ in series] == list(range(2, 17, 2))  # every report once, at its step


def test_a_run_in_an_object_store_writes_event_files_only_to_metrics_dir(make_config, train_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    train_run(make_config(save_folder=f"memory://{tmp_path.name}-a", max_duration="1ep"))
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
    train_run(
        make_config(save_folder=f"memory://{tmp_path.name}-b", max_duration="1ep", metrics_dir=str(tmp_path / "tb"))
    )
    metrics_log.close_all()
    assert_one_curve(scalars(tmp_path / "tb" / "r"), 8)


def test_a_confined_run_writes_no_event_files_outside_the_allowed_roots(make_config, tmp_path, caplog):
    from checkpointing.io import confine

    config = make_config(max_duration="1ep", metrics_dir=str(tmp_path / "elsewhere"))
    with caplog.at_level(logging.WARNING, logger="training.unit"), confine.confined([str(tmp_path / "runs")]):
        result = run_unit(config)
    assert result.progress["step"] == 8
    assert not (tmp_path / "elsewhere").exists()
    assert [r.getMessage() for r in caplog.records if "TensorBoard metrics are off" in r.getMessage()]


def test_mlflow_params_are_the_config_without_credentials(make_config):
    from training.metrics.mlflow_log import params_of

    config = make_config(
        storage_options={"key": "AKIA-not-a-param", "secret": "s3cr3t"},
        recipe_args={"num_samples": 256, "api_key": "sk-not-a-param"},
    )
    params = params_of(config)
    assert params["max_duration"] == "3ep" and params["run_name"] == "r"
    assert json.loads(params["recipe_args"]) == {"num_samples": 256, "api_key": "<redacted>"}
    assert "storage_options" not in params
    assert not [v for v in params.values() if "not-a-param" in v or "s3cr3t" in v]


def test_writers_of_many_runs_in_one_process_stay_few(make_config, tmp_path):
    for name in ("a", "b", "c", "d"):
        run_unit(make_config(run_name=name, max_duration="1ep"))
    assert len(metrics_log._LOGS) == metrics_log.KEEP_OPEN
    metrics_log.close_all()
    for name in ("a", "b", "c", "d"):
        assert_one_curve(scalars(tmp_path / "runs" / name / "tb"), 8)


def test_a_new_event_file_sorts_after_the_newest_one_of_the_same_second(make_config, tmp_path):
    import time

    from training.start.store import open_store

    config = make_config()
    folder = tmp_path / "runs" / "r" / "tb"
    folder.mkdir(parents=True)
    newest = f"events.out.tfevents.{int(time.time()):010d}.zz-a-host-named-late.99999.99"
    (folder / newest).write_bytes(b"")
    metrics_log.metrics_for(config, open_store(config)).start(8)
    assert sorted(p.name for p in folder.glob("events.out.tfevents.*"))[-1] != newest  # readers take it last


def test_a_complete_run_leaves_no_writer_thread_and_its_event_file_whole(make_config, train_run, tmp_path):
    """``train(config)`` from Python owns its threads: TensorBoard's writer (a thread and an open file) closes when
    the run completes, after the final evaluation's curve, not when the process ends (issue 45)."""
    import threading

    before = {t.ident for t in threading.enumerate()}
    train_run(make_config(max_duration="1ep"))
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == [], f"threads the complete run left running: {left}"
    assert metrics_log._LOGS == {}
    assert_one_curve(scalars(tmp_path / "runs" / "r" / "tb"), 8)
    assert [s for s, _ in scalars(tmp_path / "runs" / "r" / "tb", "eval/loss")] == [8]
