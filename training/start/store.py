"""The run's store, opened one way: its folder, its storage options and its retry policy, from the config.

Everything before the first step and every unit after it opens the store here (training/run.py, training/unit/,
flows/cli.py, the sweep's flows and trials), so a retry setting means the same for every call of the run.
"""

from __future__ import annotations

from checkpointing import CheckpointStore
from checkpointing.commit.committer import Retention
from checkpointing.io.storage import RetrySettings
from training.config import TrainConfig


def store_retry(config: TrainConfig) -> RetrySettings:
    """The run's object-store retry policy (every store call of the run, release.json included)."""
    return RetrySettings(attempts=config.store_retry_attempts, max_seconds=config.store_retry_max_seconds)


def retention(config: TrainConfig) -> Retention:
    """How many of the run's checkpoints are kept, and by which metric the best are chosen (every commit of the run)."""
    return Retention(config.num_checkpoints_to_keep, config.checkpoint_score_attribute, config.checkpoint_score_order)


def open_store(config: TrainConfig) -> CheckpointStore:
    return CheckpointStore(
        config.save_folder, config.run_name, storage_options=config.storage_options, retry=store_retry(config)
    )
