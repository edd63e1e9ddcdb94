"""The run's configuration: ``TrainConfig`` (flags, ``TRAIN_*`` variables, a config file), the checks of its fields,
its durations, and what the worker's environment allows a run (recipes, roots, processes and machines).

The face: ``from training.config import TrainConfig, ConfigError, Duration, load_config, describe_error``.
"""

from training.config.durations import Duration
from training.config.settings import TrainConfig, describe_error, load_config
from training.exceptions import ConfigError

__all__ = ["ConfigError", "Duration", "TrainConfig", "describe_error", "load_config"]
