"""The training flow: plan the remaining units, run each as a retryable task, evaluate, report.

python -m flows.train --run_name demo --max_duration 5ep
TRAIN_SAVE_FOLDER=s3://bucket/runs python -m flows.train
from flows.train import train, TrainConfig; train(TrainConfig(run_name="x"))
"""

from __future__ import annotations

import sys

from prefect import flow
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from checkpointing import CheckpointError
from checkpointing.export import export_checkpoint
from flows.artifacts import RunReport
from tasks import evaluate, unit_task
from training.config import ConfigError, TrainConfig, describe_error, load_config
from training.loop import UnitResult
from training.progress import Progress, is_complete, rescaled, unit_index
from training.recipe import load_recipe
from training.session import open_store
from training.warm_start import check_before_start, check_load_path

__all__ = ["RestartLimitError", "TrainConfig", "TrainResult", "check_restart_cap", "main", "train"]


class RestartLimitError(RuntimeError):
    """The flow run was restarted more often than ``max_restarts``: it ends Failed, which no automation restarts."""


class TrainResult(BaseModel):
    """What a run reports: where it stands and where its last checkpoint is (never the model)."""

    run_name: str
    checkpoint: str
    epoch: int
    step: int
    samples_seen: int
    sample_in_epoch: int
    metrics: dict[str, float]
    units: list[UnitResult]
    started_from: str


@flow(name="train", flow_run_name="{config.run_name}", validate_parameters=True)
def train(config: TrainConfig) -> TrainResult:
    """Train ``config.recipe`` to ``config.max_duration``, one checkpointed unit per task."""
    log = get_run_logger()
    check_restart_cap(config.max_restarts)
    load_recipe(config)  # a bad recipe or recipe_args fails here, before anything is written
    store = open_store(config)
    start = store.latest()
    if start is not None and not config.autoresume and flow_run.run_count <= 1:
        raise ConfigError(
            f"autoresume=False but run_name={config.run_name!r} already has checkpoints in "
            f"{store.uri}; set autoresume=True to continue it, or choose a new run_name"
        )
    if start is None and config.load_path:
        _check_load_path(config)
    # Claimed before resolving where to start: an older writer's commits after this point are refused.
    generation = store.claim_generation(label=f"flow run {flow_run.id or 'local'} (run {flow_run.run_count})")
    start = store.latest()
    progress = rescaled(Progress.from_dict(start.progress), config.global_batch_size) if start else Progress()
    log.info(
        "run %s in %s: %s; %s to train",
        config.run_name,
        store.uri,
        f"resuming from checkpoint {start.name}" if start else "no checkpoint yet",
        "nothing left" if is_complete(progress, config.duration) else config.max_duration,
    )
    report = RunReport(config, store, start, log)

    run_unit_task, units = unit_task(config), []
    while not is_complete(progress, config.duration):
        result = run_unit_task(
            config,
            unit=unit_index(progress, config.interval),
            start_checkpoint=start.name if start else None,
            generation=generation,
        )
        if result.metrics.get("steps", 0) == 0 and not result.complete:
            raise RuntimeError(f"unit {result.unit} trained no step; stopping rather than looping")
        progress, units = Progress.from_dict(result.progress), [*units, result]
        report.unit_done(result)
        if config.eval_each_unit and not result.complete:
            evaluate(config, result.checkpoint_name)

    final_name = units[-1].checkpoint_name if units else start.name
    final_uri = units[-1].checkpoint if units else start.uri
    metrics = evaluate(config, final_name)
    report.finish(units, metrics, started_from=f"checkpoint {start.name}" if start else "no checkpoint")
    log.info(
        "run %s complete: epoch %d, step %d, %d samples; %d unit(s) trained now; checkpoint %s; %s",
        config.run_name,
        progress.epoch,
        progress.step,
        progress.samples_seen,
        len(units),
        final_uri,
        ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
    )
    if config.export_on_complete:
        log.info(export_checkpoint(final_uri, config.export_on_complete, storage_options=config.storage_options))
    return TrainResult(
        run_name=config.run_name,
        checkpoint=final_uri,
        epoch=progress.epoch,
        step=progress.step,
        samples_seen=progress.samples_seen,
        sample_in_epoch=progress.sample_in_epoch,
        metrics=metrics,
        units=units,
        started_from=f"checkpoint {start.name}" if start else "no checkpoint",
    )


def check_restart_cap(max_restarts: int) -> None:
    """Ends the flow run Failed once it has been restarted (rescheduled after a crash) ``max_restarts`` times."""
    restarts = (flow_run.run_count or 1) - 1
    if restarts > max_restarts:
        raise RestartLimitError(
            f"flow run {flow_run.id} was restarted {restarts} times after crashes, more than "
            f"max_restarts={max_restarts}; ending Failed instead of resuming again. Look at "
            f"why it keeps dying, then start a new run (it resumes from the last checkpoint)."
        )


def _check_load_path(config: TrainConfig) -> None:
    check_load_path(config)  # a folder, or a safe weights file that fits the model; else ConfigError


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.train``: exit 0 when the run is complete, else non-zero with one clear message."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = load_config(argv)
    except ValidationError as exc:
        print(f"error: invalid configuration:\n{describe_error(exc)}", file=sys.stderr)
        return 2
    except (SettingsError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        load_recipe(config)  # fail on a bad recipe before a Prefect server is even started
        check_before_start(config)  # ... and on a bad load_path (the flow does not read it twice)
        result = train(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"error: run {config.run_name!r}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"error: run {config.run_name!r} did not complete: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    metrics = ", ".join(f"{k}={v:.4f}" for k, v in result.metrics.items())
    print(
        f"run {result.run_name} complete: epoch {result.epoch}, step {result.step}, "
        f"{result.samples_seen} samples; {metrics}; checkpoint {result.checkpoint}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
