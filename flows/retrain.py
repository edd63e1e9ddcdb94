"""Scheduled retraining: warm-start from the released model, train, evaluate, promote only if not worse.

One run per schedule tick. Its run name is the tick's scheduled time and the start of its flow-run id
(``retrain-20261122T0300-1f0c2a9e``): two ticks in one minute (two manual runs) are two runs, and a crashed tick
that Prefect reschedules keeps both (the same flow-run id and expected start time), so it resumes its own
checkpoints instead of starting over. The released model is named by a small pointer object next to the runs,
``<save_folder>/release.json`` (checkpointing/release.py: read as untrusted, retried like every store call):
a tick warm-starts from it, never from its own run, and rewrites it only when the new model is at least as good.

    python -m flows.retrain --save_folder s3://bucket/runs --metric accuracy   # and any flag of flows.train
"""

from __future__ import annotations

import logging
import math
import sys
import time
from datetime import UTC
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel

from checkpointing import validate_name
from checkpointing.release import Release, ReleaseFile
from flows import cli, ship_module_logs
from flows.options import RetrainOptions
from flows.restarts import AttemptAlive, end_dead_attempts, is_deployment_run
from flows.train import TrainResult, check_restart_cap, refuse_storage_options_from_parameters, train
from training.config import ConfigError, TrainConfig
from training.config.trust import confine_locations, release_locations
from training.start.store import store_retry

# Named, not __name__: a worker loads this file from its deployment's entrypoint as a module named "retrain".
logger = logging.getLogger("flows.retrain")


DEFAULTS = RetrainOptions()


class RetrainResult(BaseModel):
    """What one tick did: its run, whether it was promoted, both scores, and the release it leaves."""

    run_name: str
    promoted: bool
    metric: str
    new_value: float
    released_value: float | None
    release_checkpoint: str
    reason: str


def release_file(config: TrainConfig) -> ReleaseFile:
    """``<save_folder>/release.json``, with the run's storage options and store retry settings."""
    return ReleaseFile(config.save_folder, storage_options=config.storage_options, retry=store_retry(config))


def tick_run_name(prefix: str) -> str:
    """``<prefix>-<scheduled start, UTC, to the minute>-<flow-run id, 8 hex digits>``: one per tick, even for two
    ticks in one minute, and the same for every restart of one tick."""
    scheduled = flow_run.scheduled_start_time.astimezone(UTC)
    return validate_name(f"{prefix}-{scheduled:%Y%m%dT%H%M}-{str(flow_run.id)[:8]}", "run_prefix")


def warm_start(config: TrainConfig, run_name: str, release: Release | None) -> dict[str, Any]:
    """The config updates of a tick: its run name, and the release's weights unless the release is this tick's
    own model (promoted before a crash: the restarted tick resumes its run, it does not start from itself)."""
    updates: dict[str, Any] = {"run_name": run_name}
    own_run = f"{config.save_folder.rstrip('/')}/{run_name}/"
    if release is not None and release.run_name != run_name and not release.checkpoint.startswith(own_run):
        updates.update(load_path=release.checkpoint, load_weights_only=True)
    return updates


def is_not_worse(new: float, old: float, higher_is_better: bool) -> bool:
    return new >= old if higher_is_better else new <= old


@flow(name="retrain", validate_parameters=True)
def retrain(
    config: TrainConfig,
    metric: str = DEFAULTS.metric,
    higher_is_better: bool = DEFAULTS.higher_is_better,
    run_prefix: str = DEFAULTS.run_prefix,
) -> RetrainResult:
    """Train one tick's model from the release's weights; promote it if ``metric`` is not worse."""
    ship_module_logs()
    end_dead_attempts()
    check_restart_cap(config.max_restarts)
    refuse_storage_options_from_parameters()
    if not is_deployment_run():
        return tick(config, metric, higher_is_better, run_prefix)
    confine_locations(config)  # release.json too, read and written through no link, under the worker's roots
    try:
        with AttemptAlive():  # this run's sign of life every 5 s, which the reconciler reads (deployments/recovery.py)
            return tick(config, metric, higher_is_better, run_prefix)
    finally:
        release_locations()


def tick(config: TrainConfig, metric: str, higher_is_better: bool, run_prefix: str) -> RetrainResult:
    run_name = tick_run_name(run_prefix)
    release = release_file(config).read()
    updates = warm_start(config, run_name, release)
    if release is not None and "load_path" in updates:
        logger.info(
            "tick %s warm-starts from the release %s (%s %s=%.4f)",
            run_name,
            release.checkpoint,
            release.run_name,
            release.metric,
            release.value,
        )
    elif release is not None:
        logger.info("tick %s: the release is this tick's own model; resuming its run, not starting from it", run_name)
    else:
        logger.info("tick %s: no release in %s yet; training from scratch", run_name, config.save_folder)
    result = train(config.model_copy(update=updates))
    return decide(config, result, release, metric, higher_is_better)


def metric_value(metrics: dict[str, float], metric: str) -> float | None:
    """``metric`` of an evaluation, by its name with or without ``eval_`` (releases before 0.2 have it without)."""
    bare = metric.removeprefix("eval_")
    for name in (metric, f"eval_{bare}", bare):
        if name in metrics:
            return metrics[name]
    return None


def decide(
    config: TrainConfig, result: TrainResult, release: Release | None, metric: str, higher_is_better: bool
) -> RetrainResult:
    """Promotes ``result`` (rewrites release.json) unless it is worse than the release on ``metric``."""
    new = metric_value(result.metrics, metric)
    if new is None:
        raise ConfigError(
            f"metric={metric!r}: the recipe's evaluation reports {sorted(result.metrics)}; choose one of those"
        )
    old = metric_value(release.metrics, metric) if release is not None else None
    direction = "higher" if higher_is_better else "lower"
    promoted = math.isfinite(new) and (old is None or is_not_worse(new, old, higher_is_better))
    if promoted:
        release_file(config).write(
            Release(
                run_name=result.run_name,
                checkpoint=result.checkpoint,
                metric=metric,
                value=new,
                metrics={k: v for k, v in result.metrics.items() if math.isfinite(v)},
                promoted_at=time.time(),
                flow_run_id=flow_run.id,
            )
        )
        reason = f"retrain decision: promoted {result.run_name}: {metric} {new:.4f}" + (
            f" is not worse than the release's {old:.4f} ({direction} is better)"
            if old is not None
            else " (first release)"
        )
        logger.info(reason)
    else:
        kept = f"kept the release {release.run_name}" if release is not None else "released nothing"
        worse = f"worse than {old:.4f} ({direction} is better)" if math.isfinite(new) else "not a finite number"
        reason = f"retrain decision: {kept}: {result.run_name}'s {metric} {new:.4f} is {worse}"
        logger.warning(reason)
    return RetrainResult(
        run_name=result.run_name,
        promoted=promoted,
        metric=metric,
        new_value=new,
        released_value=old,
        release_checkpoint=result.checkpoint if promoted else release.checkpoint if release is not None else "",
        reason=reason,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.retrain``: one tick by hand, exiting like ``python -m flows.train``."""
    return cli.run(retrain, sys.argv[1:] if argv is None else argv, lambda result: result.reason, RetrainOptions)


if __name__ == "__main__":
    sys.exit(main())
