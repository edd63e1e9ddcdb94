"""The unit task: resolve the latest good checkpoint, train one unit, commit, report.

Because every attempt starts by resolving the run's latest checkpoint, a Prefect retry is an
autoresume. Configuration mistakes, unsafe checkpoints and fenced (stale) writers are not retried.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from checkpointing import FencedError, NotACheckpointError, PermanentStorageError, UnsafeCheckpointError
from training.config import ConfigError, TrainConfig
from training.distributed import launch_unit
from training.evaluation import evaluate_checkpoint
from training.loop import UnitResult, run_unit

# Mistakes and permanent conditions: a retry would fail the same way, after a backoff and a wall of tracebacks.
_NOT_RETRIED = (ConfigError, UnsafeCheckpointError, FencedError, NotACheckpointError, PermanentStorageError)


def retry_unless_permanent(task, task_run, state) -> bool:
    """Retry condition (a plain function: Prefect 3.8 ignores partials and callable objects)."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return not isinstance(exc, _NOT_RETRIED)


@task(
    name="train_unit",
    task_run_name="{config.run_name}-unit-{unit}",
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless_permanent,
    retry_jitter_factor=0.5,
)
def train_unit(config: TrainConfig, unit: int, start_checkpoint: str | None = None, generation: int = 0) -> UnitResult:
    """Train unit ``unit`` of the run, resuming from its newest good checkpoint."""
    log = get_run_logger()
    try:
        if config.nproc_per_node > 1 or config.nnodes > 1 or config.parallelism == "fsdp":
            result = launch_unit(config, attempt=task_run.run_count, generation=generation, log=log)
        else:
            result = run_unit(
                config, start_checkpoint=start_checkpoint, attempt=task_run.run_count, generation=generation, log=log
            )
    except Exception as exc:
        _failures[task_run.id] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        raise
    result.previous_failure = _failures.pop(task_run.id, "") if result.attempt > 1 else ""
    return result


# Why a task run's last attempt failed, for its retry's report. Prefect retries a task in the same process;
# its own record of the failed state reaches the API asynchronously (events), too late to read here.
_failures: dict[Any, str] = {}


def unit_task(config: TrainConfig):
    """``train_unit`` with the config's retry count and exponential backoff (with jitter)."""
    delays = exponential_backoff(config.retry_delay_seconds)(config.unit_retries) if config.unit_retries else 0
    return train_unit.with_options(retries=config.unit_retries, retry_delay_seconds=delays)


@task(
    name="evaluate",
    task_run_name="{config.run_name}-evaluate-{checkpoint_name}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_unless_permanent,
)
def evaluate(config: TrainConfig, checkpoint_name: str) -> dict[str, float]:
    """Evaluate a committed checkpoint on the recipe's eval split."""
    metrics = evaluate_checkpoint(config, checkpoint_name)
    get_run_logger().info(
        "evaluation of %s: %s",
        checkpoint_name,
        ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "recipe has no eval split",
    )
    return metrics
