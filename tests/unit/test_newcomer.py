"""What a newcomer meets first reads right (issue 47): ``--help``'s types and defaults, a retry's delay, a polite
stop's log lines, and the synthetic recipe's eval accuracy."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.docs_blocks import ROOT
from training.config import TrainConfig

UNREADABLE = re.compile(r"<lambda>|default factory|dict\[|list\[|\bAny\b")


@pytest.mark.parametrize("command", ["flows.train", "flows.sweep", "flows.retrain"])
def test_help_names_every_type_and_default_as_a_person_types_them(command: str):
    env = {**os.environ, "COLUMNS": "250"}  # a default is never cut by the wrapping
    out = subprocess.run(
        [sys.executable, "-m", command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert not UNREADABLE.findall(out.stdout), [line for line in out.stdout.splitlines() if UNREADABLE.search(line)]
    flags = _entries(out.stdout)
    for name, field in TrainConfig.model_fields.items():  # a factory's default is the JSON that gives it
        if field.default_factory is not None:
            entry = flags[f"--{name}"]
            assert entry.startswith(f"--{name} JSON "), entry
            assert entry.endswith(f"(default: {json.dumps(field.default_factory())})"), entry  # type: ignore[call-arg]
    assert flags["--preemption_signals"].endswith('(default: ["SIGTERM"])')


def _entries(help_text: str) -> dict[str, str]:
    """Each flag's entry of an argparse help (its line and the indented lines under it), on one line."""
    entries: dict[str, str] = {}
    flag = ""
    for line in help_text.partition("options:")[2].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            entries[flag] = line.strip()
        elif flag and line.startswith("   "):
            entries[flag] += " " + line.strip()
    return entries


def test_a_retry_delay_prints_at_most_two_decimals_and_keeps_its_backoff(make_config):
    from tasks.train_unit import JITTER, retry_delays

    config = make_config(unit_retries=4, retry_delay_seconds=1.5)
    for _ in range(50):
        delays = retry_delays(config)
        assert isinstance(delays, list) and len(delays) == 4
        for i, delay in enumerate(delays):
            base = 1.5 * 2**i
            assert base - 0.005 <= delay <= base * (1 + JITTER) + 0.005, delays
            assert len(str(delay).partition(".")[2]) <= 2, delays  # Prefect prints str(delay) "second(s) from now"


def test_a_stopped_task_run_finishes_with_an_info_line_and_a_failed_one_keeps_its_error():
    """Prefect's own task engine writes the line (TaskRunEngine.log_finished_message), as at the end of a unit that
    a SIGTERM stopped; docs/preemption.md says the run's one error line is the CLI's."""
    from prefect.client.schemas.objects import TaskRun
    from prefect.settings import PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW, temporary_settings
    from prefect.states import Failed
    from prefect.task_engine import SyncTaskRunEngine

    from tasks.train_unit import stopped, train_unit
    from training.preemption import Preempted, Stop

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger("prefect.task_runs")
    stop = Stop("signal", "preempted by SIGTERM", time.monotonic(), signum=signal.SIGTERM)
    states = [stopped(Preempted(stop, "ep0-ba4-sa128", 4, 0.1)), Failed(message="the unit raised")]
    logger.addHandler(handler)
    try:
        with temporary_settings({PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW: "ignore"}):  # no flow run: no API logs
            for state in states:
                run = TaskRun(task_key="train_unit", dynamic_key="1", name="r-unit-1", state=state)
                SyncTaskRunEngine(task=train_unit, task_run=run, logger=logger).log_finished_message()
    finally:
        logger.removeHandler(handler)
    assert [(r.levelname, r.getMessage().split("(")[0]) for r in seen] == [
        ("INFO", "Finished in state Preempted"),
        ("ERROR", "Finished in state Failed"),
    ]


def test_the_synthetic_recipe_evaluates_what_it_learned(make_config, train_run):
    """Its eval split is labelled by the train split's teacher: at chance (0.25 for 4 classes) it measured nothing."""
    result = train_run(make_config(recipe_args={"num_samples": 512}, unit_retries=0, tensorboard=False))
    assert result.metrics["eval_accuracy"] >= 0.6, result.metrics  # 0.83 measured; 0.22 with another teacher
    assert result.metrics["eval_loss"] < 1.0, result.metrics  # 0.40 measured; 3.1 with another teacher


def test_the_readme_promises_the_metrics_the_last_line_shows(make_config, train_run):
    """README.md quotes `make demo`'s last line; its metrics are the final evaluation's, named as done_line writes
    them (a recipe's evaluate() says 'loss' and 'accuracy'; the line says 'eval_loss', 'eval_accuracy')."""
    from flows.train import done_line

    readme = " ".join((ROOT / "README.md").read_text().split())
    promised = readme.split("`make demo` ends with one line that says what happened: `", 1)[1].split("`", 1)[0]
    metrics = promised.split(" samples; ", 1)[1].split(". Unit ", 1)[0]  # "eval_loss ..., eval_accuracy ..."
    pattern = r" samples; " + re.escape(metrics).replace(re.escape("..."), r"\d+\.\d{4}") + r"\. Checkpoint: "
    line = done_line(train_run(make_config(max_duration="1ep", tensorboard=False)))
    assert re.search(pattern, line), (metrics, line)
