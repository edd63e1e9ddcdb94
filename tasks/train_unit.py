"""The unit task: resolve the latest good checkpoint, train one unit (or a recipe's own loop), commit, report.

Because every attempt starts by resolving the run's latest checkpoint, a Prefect retry is an autoresume.
Configuration mistakes, unsafe checkpoints and fenced (stale) writers are not retried; neither is a preemption:
a unit stopped on request ends its task run Cancelled, named ``Preempted``, with the ``Preempted`` stop as its data,
which ``unit_outcome`` raises again in the flow (the flow decides what happens next). Raised out of the task instead,
Prefect's task engine would show every polite stop as Crashed, the state of a process that died.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import task_run
from prefect.states import Cancelled, State
from prefect.tasks import exponential_backoff

from tasks import stopped_log
from tasks.nodes import node_launcher
from training.config import TrainConfig
from training.exceptions import Permanent, RankDied
from training.preemption import Preempted
from training.run import execute_unit
from training.run_states import PREEMPTED, SUPERSEDED
from training.unit.evaluation import evaluate_checkpoint
from training.unit.loop import UnitResult

T = TypeVar("T")
# The names of a stopped task run's state (a Cancelled one); a preempted deployment run's Scheduled state is named
# PREEMPTED too (flows/restarts.py).
stopped_log.install((PREEMPTED, SUPERSEDED))  # their task runs finish with an INFO line, not Prefect's ERROR
JITTER = 0.5  # each retry waits its exponential delay times a random factor in [1, 1 + JITTER]
_JITTER = random.SystemRandom()  # never the training thread's generator (training/unit/rng.py)


def retry_unless_permanent(task, task_run, state) -> bool:
    """Retry condition (a plain function: Prefect 3.8 ignores partials and callable objects). Mistakes and permanent
    conditions (training/exceptions.py, checkpointing/errors.py) are not retried: a retry would fail the same way,
    after a backoff and a wall of tracebacks."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return not isinstance(exc, Permanent)


# The run name ends in "-unit-<n>": the run summary counts these tasks' retries (a loop of its own is unit 0).
@task(
    name="train_unit",
    task_run_name="{config.run_name}-unit-{unit}",
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless_permanent,
)
def train_unit(
    config: TrainConfig,
    unit: int,
    start_checkpoint: str | None = None,
    generation: int = 0,
    on_report: Callable[[UnitResult], None] | None = None,
) -> UnitResult | State:
    """Train unit ``unit`` of the run (or the recipe's own loop), resuming from its newest good checkpoint.
    ``on_report`` (in-process, e.g. the flow's UI report) sees each committed checkpoint as a UnitResult."""
    try:
        result = execute_unit(
            config,
            unit=unit,
            start_checkpoint=start_checkpoint,
            attempt=task_run.run_count,
            generation=generation,
            on_report=on_report,
            launch_nodes=node_launcher,
        )
    except Preempted as stop:
        return stopped(stop)
    except Exception as exc:
        _failures[task_run.id] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        _note_repeated_death(exc, task_run.id, task_run.run_count)
        raise
    result.previous_failure = _failures.pop(task_run.id, "") if result.attempt > 1 else ""
    _deaths.pop(task_run.id, None)
    return result


def stopped(stop: Preempted) -> State:
    """The final state of a task run that stopped on request: Cancelled, named Preempted (a termination signal) or
    Superseded (a newer attempt took the run over), carrying the stop."""
    return Cancelled(name=PREEMPTED if stop.stop.kind == "signal" else SUPERSEDED, message=str(stop), data=stop)


def unit_outcome(result: T | State) -> T:
    """What a unit or evaluation task returned, or the ``Preempted`` it stopped with, raised again."""
    if isinstance(result, State):
        result.result(raise_on_failure=True)  # raises the state's data: the Preempted stop
        raise RuntimeError(f"a task ended {result.name!r} without its stop")  # a broken invariant, not user input
    return result


def _note_repeated_death(exc: Exception, task_run_id: Any, attempt: int) -> None:
    """One line when a rank dies the same way at the same step as in this task run's previous attempt: a
    deterministic crash, which ends the run Failed once its retries are spent (Failed is never restarted)."""
    if not isinstance(exc, RankDied):
        _deaths.pop(task_run_id, None)
        return
    before = _deaths.get(task_run_id)
    _deaths[task_run_id] = exc.signature
    if exc.signature is not None and before == exc.signature:
        rank, code, step = exc.signature
        get_run_logger().error(
            "the same crash again in attempt %d: rank %s died (exit %s) after step %s, as in the attempt before "
            "(a deterministic crash: the run ends Failed when its retries are spent)",
            attempt,
            rank,
            code,
            step,
        )


_deaths: dict[Any, tuple | None] = {}  # each task run's last rank death: (rank, exit, step)

# Why a task run's last attempt failed, for its retry's report. Prefect retries a task in the same process;
# its own record of the failed state reaches the API asynchronously (events), too late to read here.
_failures: dict[Any, str] = {}


def retry_delays(config: TrainConfig) -> list[float] | float:
    """Exponential backoff with jitter drawn here, from a generator of our own: Prefect's ``retry_jitter_factor``
    draws from the global ``random`` on the training thread, whose state training seeds and restores, so every
    run retried after the same wait (and the draw shifted the recipe's stream). Rounded to 0.01 s: Prefect prints the
    delay as given ("Retry 1/2 will start 1.08 second(s) from now", not 16 digits)."""
    if not config.unit_retries:
        return 0
    delays = exponential_backoff(config.retry_delay_seconds)(config.unit_retries)
    return [round(d * (1 + JITTER * _JITTER.random()), 2) for d in delays]


def unit_task(config: TrainConfig):
    """``train_unit`` with the config's retry count and exponential backoff (with jitter)."""
    return train_unit.with_options(retries=config.unit_retries, retry_delay_seconds=retry_delays(config))


@task(
    name="evaluate",
    task_run_name="{config.run_name}-evaluate-{checkpoint_name}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_unless_permanent,
)
def evaluate(config: TrainConfig, checkpoint_name: str) -> dict[str, float] | State:
    """Evaluate a committed checkpoint on the recipe's eval split; metrics named ``eval_<metric>``."""
    try:
        metrics = {f"eval_{k}": v for k, v in evaluate_checkpoint(config, checkpoint_name).items()}
    except Preempted as stop:
        return stopped(stop)
    get_run_logger().info(
        "evaluation of %s: %s",
        checkpoint_name,
        ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "recipe has no eval split",
    )
    return metrics
