"""The training flow: open the run, train each unit as a retryable task, evaluate, report.

python -m flows.train --run_name demo --max_duration 5ep
TRAIN_SAVE_FOLDER=s3://bucket/runs python -m flows.train
from flows.train import train, TrainConfig; train(TrainConfig(run_name="x"))

The run's lifecycle (checks, claim, roll-back, where to start, the end) is training.run.Run, which knows nothing
of Prefect; this flow adds what is Prefect's: the restart cap, the trust of parameters, tasks with retries, the
UI's artifacts, and the state a preempted attempt leaves the flow run in (flows/restarts.py).
"""

# No `from __future__ import annotations` here: serve() runs the flow from a by-value cloudpickle of its function,
# which keeps none of this module's globals, so a string annotation 'TrainConfig' could not be resolved when Prefect
# validates the `config` parameter (every served run failed with PydanticUserError "TrainModel is not fully defined").
import sys

from prefect import Flow
from prefect.context import FlowRunContext, TagsContext
from prefect.runtime import flow_run

from checkpointing import FencedError
from flows import cli, ship_module_logs
from flows.artifacts import RunReport
from flows.restarts import (
    AttemptAlive,
    StoppedRun,
    end_dead_attempts,
    flow_run_attempt,
    leave,
    leave_superseded,
    parameters_untrusted,
    restart_count,
    superseded_by_this_flow_run,
)
from flows.server import prefect_api
from tasks import evaluate, unit_outcome, unit_task
from tasks.trial import TRIAL_TAG
from training import preemption
from training.config import ConfigError, TrainConfig
from training.exceptions import RestartLimitError
from training.preemption import Preempted
from training.recipe.loader import allow_recipe
from training.run import Run, TrainResult
from training.start import phases
from training.unit.warm import PROCESS

__all__ = ["Preempted", "RestartLimitError", "TrainConfig", "TrainResult", "allow_recipe", "main", "train"]


class TrainFlow(Flow):
    """``train(config)`` called from Python runs against the Prefect API that ``python -m flows.train`` uses: a
    running server, or a temporary one of ours that stops with this process (Prefect's own outlives a SIGKILL).
    A run stopped on request raises ``Preempted`` to its caller, though Prefect saw it end Cancelled (StoppedRun)."""

    def __call__(self, *args, **kwargs):
        try:
            if FlowRunContext.get() is not None:  # a subflow: the API is already there
                return super().__call__(*args, **kwargs)
            with prefect_api():
                return super().__call__(*args, **kwargs)
        except StoppedRun as ended:
            raise ended.stop from None


def train_flow(config: TrainConfig) -> TrainResult:
    """Train ``config.recipe`` to ``config.max_duration``, one checkpointed unit per task."""
    clock = phases.starting()  # the run's first log line says where its start-up went (training/start/phases.py)
    ship_module_logs()
    end_dead_attempts()  # before this attempt creates a task run of its own
    check_restart_cap(config.max_restarts)
    clock.mark("restart checks")
    refuse_storage_options_from_parameters()
    owner, attempt = flow_run.id or "", flow_run_attempt()
    label = f"flow run {owner or 'local'} (run {attempt})"
    try:
        with (
            preemption.handling(config.preemption_signals, hold=True),  # after a stop, until the process exits
            Run.open(
                config, attempt=attempt, owner=owner, label=label, untrusted=parameters_untrusted(), phases=clock
            ) as run,
            AttemptAlive(),
            tasks_without_trial_tag(),
        ):
            try:
                return _train(config, run)
            except FencedError:
                if superseded_by_this_flow_run(run.store):  # a newer attempt of this run took over: not a failure
                    raise leave_superseded() from None
                raise
    except Preempted as stop:
        raise leave(stop) from None


train = TrainFlow(train_flow, name="train", flow_run_name="{config.run_name}", validate_parameters=True)


def _train(config: TrainConfig, run: Run) -> TrainResult:
    report = RunReport(config, run.store, run.start)
    task = unit_task(config)
    try:
        while not run.complete:
            stopped_between_units(run)
            result = task(
                config,
                unit=run.next_unit,
                start_checkpoint=run.head,
                generation=run.generation,
                on_report=report.unit_done,
            )
            run.record(unit_outcome(result))
        metrics = run.final_metrics()
        if metrics is None and run.head is not None:
            metrics = unit_outcome(evaluate(config, run.head))
        report.finish(run.units, metrics or {}, started_from=run.started_from)
        return run.finish(metrics or {})
    except Preempted as stop:
        report.stopped(stop)
        raise


def stopped_between_units(run: Run) -> None:
    """A stop request that arrived between two units: the last unit's checkpoint is where the run stands (once
    its upload, if one is in flight, has landed)."""
    stop = preemption.STOP.current
    if stop is None:
        return
    PROCESS.committer.wait_quietly()
    raise Preempted(stop, run.head, run.progress.step, None)


def tasks_without_trial_tag() -> TagsContext:
    """The tags this flow run's task runs get: the flow run's, less the one a sweep's trial puts on its flow run
    (``sweep-trial-<random>``, tasks/trial.py: the sweep finds a dead trial process's flow run by it). Prefect's task
    engine asks the API for a concurrency slot under every tag of a task run and releases it after: for that tag, which
    no limit can name, two calls a unit and a new client a segment, and the acquisition waited 1.6-4.8 s on the
    server under load (issue 46). A user's own tags stay (a concurrency limit on them still holds)."""
    current = TagsContext.get().current_tags
    return TagsContext(current_tags={tag for tag in current if not tag.startswith(TRIAL_TAG)})


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
    """Ends the flow run Failed once it has run again (after a crash or a preemption) ``max_restarts`` times."""
    restarts = restart_count()
    if restarts > max_restarts:
        raise RestartLimitError(
            f"flow run {flow_run.id} was restarted {restarts} times (crashes and preemptions), more than "
            f"max_restarts={max_restarts}; ending Failed instead of resuming again. Look at "
            f"why it keeps dying, then start a new run (it resumes from the last checkpoint)."
        )


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
        f"{metrics}.{faults} Checkpoint: {result.checkpoint} (list them: {cli.python()} -m checkpointing ls "
        f"{result.store})"
    )
    return "\n".join([*(f"warning: {w}" for w in result.warnings), line])


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.train``: exit 0 when the run is complete, else non-zero with one clear message."""
    return cli.run(train, sys.argv[1:] if argv is None else argv, done_line)


if __name__ == "__main__":
    sys.exit(main())
