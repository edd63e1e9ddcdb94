"""The ``train`` flow for a recipe with its own ``train_loop``: one retryable task runs the loop, each report is
a checkpoint (training/own_loop.py), and the run is complete once a report reached ``max_duration``.

The preamble is the unit flow's (restart cap, storage options, pre-flight, run identity, autoresume, writer
generation, the start that verifies); then, instead of planning units, the flow calls the loop task once, if
the run is not complete yet. Each report moves the UI's progress, metrics and curves cards as a unit would.
The run's metrics are the last report's (the product does not evaluate a model it never built).
"""

from __future__ import annotations

from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from flows.artifacts import RunReport
from flows.restarts import flow_run_attempt
from flows.train import (
    TrainResult,
    finished,
    opened_run,
    overshoot_warning,
    resolve_start,
)
from tasks.own_loop import loop_task
from training.config import TrainConfig
from training.progress import Progress, is_complete


def train_own_loop(config: TrainConfig) -> TrainResult:
    """Runs ``recipe.train_loop`` until a report reaches ``max_duration`` (called inside the ``train`` flow)."""
    log = get_run_logger()
    store, start = opened_run(config)  # pre-flight refuses options a loop of its own cannot honour
    generation = store.claim_generation(label=f"flow run {flow_run.id or 'local'} (run {flow_run_attempt()})")
    start = resolve_start(config, store, log)
    progress = Progress.from_dict(start.progress) if start else Progress()  # the loop's counters: never rescaled
    warnings = [w for w in [overshoot_warning(config, store, start, progress)] if w]
    for warning in warnings:
        log.warning(warning)
    started_from = f"checkpoint {start.name}" if start else "no checkpoint"
    complete = is_complete(progress, config.duration)
    log.info("run %s in %s (train_loop): %s; %s", config.run_name, store.uri, started_from,
             "nothing left" if complete else f"training to {config.max_duration}")  # fmt: skip
    report = RunReport(config, store, start, log)

    units = []
    if not complete:
        result = loop_task(config)(config, generation=generation, on_report=report.unit_done)
        progress, units = Progress.from_dict(result.progress), [result]
    final_name, final_uri = (units[-1].checkpoint_name, units[-1].checkpoint) if units else (start.name, start.uri)
    final = store.info(final_name)
    metrics = final.metrics if final else {}  # as reported, from the manifest: a rerun returns the same
    report.finish(units, metrics, started_from=started_from)
    return finished(config, store, log, units, progress, (final_name, final_uri), metrics, started_from, warnings)
