"""Prefect flows: train and retrain.

Defaults set here, before Prefect is imported (the environment still wins):
- Prefect's server sends usage analytics; on an offline machine every command then prints a telemetry error.
- The product logs through ordinary module loggers (``logging.getLogger(__name__)``); Prefect attaches the
  ones named in PREFECT_LOGGING_EXTRA_LOGGERS to the flow run's logs, so training's and the store's lines
  reach the UI without a logger threaded through every call. A line logged outside a run (a background upload
  finishing after its unit) is simply not sent, instead of a warning each time.
"""

import logging
import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "training,checkpointing,tasks,flows")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

for _name in ("training", "checkpointing", "tasks", "flows"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.INFO)
