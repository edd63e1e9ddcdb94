"""A run driven to its end through the Prefect-free lifecycle, ``training.run.Run``, the way the ``train`` flow
drives it (flows/train.py) minus what is Prefect's: no flow or task runs, no retries, no artifacts, no server.

Tests of what a run does (where it starts, what it trains, what it returns) use this (the ``train_run`` fixture);
tests of what Prefect adds (a task's retries, its states, the UI's artifacts, flow-run parameters) call the flow.
"""

from __future__ import annotations

from training.config import TrainConfig
from training.run import Run, TrainResult, execute_unit
from training.unit.evaluation import evaluate_checkpoint


def train_to_end(config: TrainConfig) -> TrainResult:
    """Opens the run, trains every unit left (or the recipe's own loop), evaluates the final checkpoint when its
    last unit did not, and returns what ``train(config)`` returns."""
    with Run.open(config) as run:
        while not run.complete:
            run.record(execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation))
        metrics = run.final_metrics()
        if metrics is None and run.head is not None:
            metrics = {f"eval_{k}": v for k, v in evaluate_checkpoint(config, run.head).items()}
        return run.finish(metrics or {})
