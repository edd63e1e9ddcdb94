"""The task that runs a recipe's own ``train_loop`` (Ray Train's model; see training/own_loop.py).

One task run holds the whole loop; each ``ctx.report`` inside it commits a checkpoint. The retry policy is the
unit task's: a failed attempt is retried (``unit_retries``, exponential backoff with jitter) unless the failure
is permanent, and the retry calls ``train_loop`` again, whose ``ctx.get_checkpoint()`` returns the last report.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from tasks.train_unit import retry_unless_permanent
from training.config import TrainConfig
from training.loop import UnitResult
from training.own_loop import run_own_loop


# The run name ends in "-unit-..." so that the run summary counts this task's retries with the units'.
@task(
    name="train_loop",
    task_run_name="{config.run_name}-unit-loop",
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless_permanent,
    retry_jitter_factor=0.5,
)
def train_loop(
    config: TrainConfig, generation: int = 0, on_report: Callable[[UnitResult], None] | None = None
) -> UnitResult:
    """Run the recipe's ``train_loop(ctx)``; each report is a checkpoint, and a retry resumes from the last one.
    ``on_report`` (in-process, e.g. the flow's UI report) sees each report as a UnitResult."""
    return run_own_loop(
        config, attempt=task_run.run_count, generation=generation, log=get_run_logger(), on_report=on_report
    )


def loop_task(config: TrainConfig):
    """``train_loop`` with the config's retry count and exponential backoff (with jitter), as ``unit_task``."""
    delays = exponential_backoff(config.retry_delay_seconds)(config.unit_retries) if config.unit_retries else 0
    return train_loop.with_options(retries=config.unit_retries, retry_delay_seconds=delays)
