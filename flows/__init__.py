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


def product_logs_at_info() -> None:
    """The product's loggers at INFO unless set otherwise (Python's default, WARNING, would drop the unit lines).
    A flow-run process may run Prefect's logging set-up after this package was imported, which resets the levels
    of loggers it does not name: a flow that needs its lines calls this again when it starts."""
    for name in ("training", "checkpointing", "tasks", "flows"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.INFO)


product_logs_at_info()
