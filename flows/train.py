"""The training flow: plan the remaining units, run each as a retryable task, evaluate, report.

python -m flows.train --run_name demo --max_duration 5ep
TRAIN_SAVE_FOLDER=s3://bucket/runs python -m flows.train
from flows.train import train, TrainConfig; train(TrainConfig(run_name="x"))
"""

# No `from __future__ import annotations` here: serve() runs the flow from a by-value cloudpickle of its function,
# which keeps none of this module's globals, so a string annotation 'TrainConfig' could not be resolved when Prefect
# validates the `config` parameter (every served run failed with PydanticUserError "TrainModel is not fully defined").
import sys

from prefect import flow
from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel

from checkpointing import CheckpointInfo, CheckpointStore
from checkpointing.export import export_checkpoint
from checkpointing.store import split_run_uri
from flows import cli
from flows.artifacts import RunReport
from flows.restarts import flow_run_attempt, restart_count
from tasks import evaluate, unit_task
from training.config import ConfigError, TrainConfig
from training.identity import check_same_run
from training.loop import UnitResult
from training.own_loop import uses_own_loop
from training.preflight import preflight
from training.progress import Progress, at, is_complete, is_past, rescaled, unit_index
from training.recipe import allow_recipe
from training.rollback import pending_roll_back, roll_back
from training.session import open_store
from training.warm_start import check_load_path

__all__ = ["RestartLimitError", "TrainConfig", "TrainResult", "allow_recipe", "check_restart_cap", "main", "train"]

MAX_REPEATS = 2  # units that end where an earlier one ended, before the flow stops instead of retraining


class RestartLimitError(RuntimeError):
    """The flow run was restarted more often than ``max_restarts``: it ends Failed, which no automation restarts."""


class TrainResult(BaseModel):
    """What a run reports: where it stands and where its last checkpoint is (never the model)."""

    run_name: str
    checkpoint: str
    checkpoint_name: str = ""
    epoch: int
    step: int
    samples_seen: int
    sample_in_epoch: int
    metrics: dict[str, float]
    units: list[UnitResult]
    started_from: str
    store: str = ""
    warnings: list[str] = []
    best_checkpoints: list[str] = []  # URIs, best first by checkpoint_score_attribute (empty without it)
    best_checkpoint_names: list[str] = []  # the same checkpoints' names


@flow(name="train", flow_run_name="{config.run_name}", validate_parameters=True)
def train(config: TrainConfig) -> TrainResult:
    """Train ``config.recipe`` to ``config.max_duration``, one checkpointed unit per task."""
    if uses_own_loop(config):  # the recipe brings its own train_loop(ctx): one task, a checkpoint per report
        from flows.own_loop import train_own_loop

        return train_own_loop(config)
    log = get_run_logger()
    store, start = opened_run(config)
    if start is None and config.load_path:
        _check_load_path(config)
    rollback_to = pending_roll_back(config, store, log)  # a bad resume_from fails here, before anything is written
    # Claimed before resolving where to start: an older writer's commits after this point are refused.
    generation = store.claim_generation(label=f"flow run {flow_run.id or 'local'} (run {flow_run_attempt()})")
    if rollback_to:
        roll_back(store, rollback_to, generation, log)
    start = resolve_start(config, store, log)
    progress = rescaled(Progress.from_dict(start.progress), config.global_batch_size) if start else Progress()
    warnings = [
        w for w in [load_path_warning(config, store, start), overshoot_warning(config, store, start, progress)] if w
    ]
    for warning in warnings:
        log.warning(warning)
    started_from = f"checkpoint {start.name}" if start else "no checkpoint"
    log.info("run %s in %s: %s; %s to train", config.run_name, store.uri, started_from,
             "nothing left" if is_complete(progress, config.duration) else config.max_duration)  # fmt: skip
    report = RunReport(config, store, start, log)

    run_unit_task, units, guard = unit_task(config), [], RepeatGuard(progress)
    while not is_complete(progress, config.duration):
        expected = units[-1].checkpoint_name if units else (start.name if start else None)
        unit = unit_index(progress, config.interval)
        result = run_unit_task(config, unit=unit, start_checkpoint=expected, generation=generation)
        guard.check(result)
        progress, units = Progress.from_dict(result.progress), [*units, result]
        report.unit_done(result)

    final_name, final_uri = (units[-1].checkpoint_name, units[-1].checkpoint) if units else (start.name, start.uri)
    metrics = final_eval(units, progress) if units else None
    if metrics is None:
        metrics = evaluate(config, final_name)
    report.finish(units, metrics, started_from=started_from)
    return finished(config, store, log, units, progress, (final_name, final_uri), metrics, started_from, warnings)


def finished(
    config: TrainConfig,
    store: CheckpointStore,
    log,
    units: list[UnitResult],
    progress: Progress,
    final: tuple[str, str],
    metrics: dict[str, float],
    started_from: str,
    warnings: list[str],
) -> TrainResult:
    """The end of a complete run, whoever trained it (units or a train_loop): the log line, the export, the
    best checkpoints and the result."""
    final_name, final_uri = final
    log.info("run %s complete: epoch %d, step %d, %d samples; %d unit(s) trained now; checkpoint %s; %s",
             config.run_name, progress.epoch, progress.step, progress.samples_seen, len(units), final_uri,
             ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "no metrics")  # fmt: skip
    if config.export_on_complete:
        log.info(export_checkpoint(final_uri, config.export_on_complete, storage_options=config.storage_options))
    best = best_checkpoints(config, store)
    return TrainResult(
        run_name=config.run_name,
        checkpoint=final_uri,
        checkpoint_name=final_name,
        epoch=progress.epoch,
        step=progress.step,
        samples_seen=progress.samples_seen,
        sample_in_epoch=progress.sample_in_epoch,
        metrics=metrics,
        units=units,
        started_from=started_from,
        store=store.uri,
        warnings=warnings,
        best_checkpoints=[i.uri for i in best],
        best_checkpoint_names=[i.name for i in best],
    )


def opened_run(config: TrainConfig) -> tuple[CheckpointStore, CheckpointInfo | None]:
    """The checks every flow start makes before anything is written (restart cap, where storage options come
    from, pre-flight, the same run, autoresume), then the run's store and its latest checkpoint."""
    check_restart_cap(config.max_restarts)
    refuse_storage_options_from_parameters()
    preflight(config)  # recipe allowed, arguments sane, model builds: before anything is written
    store = open_store(config)
    start = store.latest()
    if start is not None:
        check_same_run(config, start)
        if not config.autoresume and flow_run_attempt() <= 1:
            raise ConfigError(
                f"autoresume=False but run_name={config.run_name!r} already has checkpoints in {store.uri}; set "
                f"autoresume=True to continue it, or choose a new run_name"
            )
    return store, start


def final_eval(units: list[UnitResult], progress: Progress) -> dict[str, float] | None:
    """The last unit's own evaluation (eval_interval) when it ran at the final step: no second pass."""
    last = units[-1].metrics
    if last.get("eval_step") != float(progress.step):
        return None
    return {k.removeprefix("eval_"): v for k, v in last.items() if k.startswith("eval_") and k != "eval_step"}


def resolve_start(config: TrainConfig, store: CheckpointStore, log) -> CheckpointInfo | None:
    """The checkpoint the run stands at. When it says the run is complete, it is what the run returns, and
    no unit will load (and hash) it: verify every byte now, and fall back to retrain what is lost."""
    start = store.latest()
    if start is None or not is_complete(Progress.from_dict(start.progress), config.duration):
        return start
    verified = store.latest(deep=True)
    if verified is None or verified.name != start.name:
        log.warning("the final checkpoint %s failed verification; resuming from %s and retraining from there",
                    start.name, verified.name if verified else "the start")  # fmt: skip
    return verified


class RepeatGuard:
    """Stops a flow whose units keep ending where an earlier unit already ended (its commits are being
    lost, e.g. a checkpoint that never verifies): it would otherwise retrain the same data forever."""

    def __init__(self, start: Progress):
        self.furthest, self.repeats = start.samples_seen, 0

    def check(self, result: UnitResult) -> None:
        if result.steps == 0 and not result.complete:
            raise RuntimeError(f"unit {result.unit} trained no step; stopping rather than looping")
        ended = result.progress.get("samples_seen", 0)
        if ended > self.furthest:
            self.furthest = ended
            return
        self.repeats += 1
        if self.repeats > MAX_REPEATS:
            raise RuntimeError(
                f"unit {result.unit} ended at {ended} samples, where earlier units of this flow run already got "
                f"({self.repeats} times): its checkpoints are not being kept (last: {result.checkpoint}). Stopping "
                f"instead of retraining the same data; check the store: python -m checkpointing verify "
                f"{'/'.join(split_run_uri(result.checkpoint)[:2])}"
            )


def best_checkpoints(config: TrainConfig, store: CheckpointStore) -> list[CheckpointInfo]:
    """Ray's ``Result.best_checkpoints``: the run's checkpoints by checkpoint_score_attribute, best first."""
    if not config.checkpoint_score_attribute:
        return []
    return store.best(config.checkpoint_score_attribute, config.checkpoint_score_order)


def load_path_warning(config: TrainConfig, store: CheckpointStore, start: CheckpointInfo | None) -> str:
    """load_path only starts a run: once the run has checkpoints it resumes from them, and is told so."""
    if start is None or not config.load_path:
        return ""
    return (
        f"load_path={config.load_path!r} is ignored: run {config.run_name!r} already has checkpoints and resumes "
        f"from its checkpoint {start.name}. To start from load_path, choose a new run_name; to go back to an "
        f"earlier checkpoint of this run, set resume_from=<checkpoint name> (python -m checkpointing ls {store.uri})"
    )


def overshoot_warning(config: TrainConfig, store: CheckpointStore, start: CheckpointInfo | None, p: Progress) -> str:
    """A launch asking for less than the run already trained gets the run's newest checkpoint, and is told so."""
    if start is None or not is_past(p, config.duration):
        return ""
    match = next((i for i in reversed(store.list()) if at(i.progress, config.duration)), None)
    there = (
        f"the checkpoint at {config.max_duration} is {match.name}; to go back to it: resume_from={match.name}"
        if match
        else f"no checkpoint sits exactly at {config.max_duration} (retention may have removed it)"
    )
    return (
        f"run {config.run_name!r} already trained past max_duration={config.max_duration} (its newest checkpoint "
        f"{start.name} is at epoch {p.epoch}, step {p.step}, {p.samples_seen} samples); returning it unchanged. "
        f"{there[0].upper()}{there[1:]}"
    )


def refuse_storage_options_from_parameters() -> None:
    """storage_options may hold credentials and endpoints: they come from the worker's environment
    (TRAIN_STORAGE_OPTIONS) or from Python, never from a flow-run parameter set through the API. Spelled in
    any case too: TrainConfig refuses such keys anyway, this does not rely on it."""
    context = FlowRunContext.get()
    raw = (context.flow_run.parameters or {}).get("config") if context and context.flow_run else None
    if isinstance(raw, dict) and any(str(key).lower().replace("-", "_") == "storage_options" for key in raw):
        raise ConfigError(
            "storage_options cannot be set through a flow-run parameter (the API stores parameters, and they "
            "choose endpoints); set TRAIN_STORAGE_OPTIONS in the environment of the worker instead"
        )


def check_restart_cap(max_restarts: int) -> None:
    """Ends the flow run Failed once it has been restarted (rescheduled after a crash) ``max_restarts`` times."""
    restarts = restart_count()
    if restarts > max_restarts:
        raise RestartLimitError(
            f"flow run {flow_run.id} was restarted {restarts} times after crashes, more than "
            f"max_restarts={max_restarts}; ending Failed instead of resuming again. Look at "
            f"why it keeps dying, then start a new run (it resumes from the last checkpoint)."
        )


def _check_load_path(config: TrainConfig) -> None:
    check_load_path(config)  # a folder, or a safe weights file that fits the model; else ConfigError


def done_line(result: TrainResult) -> str:
    """What the terminal shows at the end: warnings, then one line that tells what happened (the faults, the
    retries and where they resumed, the metrics) and where to look."""
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items()) or "no eval split"
    faults = "".join(
        f" Unit {u.unit} failed {_times(u.attempt - 1)}"
        f"{f' ({u.previous_failure})' if u.previous_failure else ''}; its retry resumed from {u.resumed_from}."
        for u in result.units
        if u.attempt > 1
    )
    line = (
        f"run {result.run_name} complete: epoch {result.epoch}, step {result.step}, {result.samples_seen} samples; "
        f"{metrics}.{faults} Checkpoint: {result.checkpoint} (list them: python -m checkpointing ls {result.store})"
    )
    return "\n".join([*(f"warning: {w}" for w in result.warnings), line])


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.train``: exit 0 when the run is complete, else non-zero with one clear message."""
    return cli.run(train, sys.argv[1:] if argv is None else argv, done_line)


if __name__ == "__main__":
    sys.exit(main())
