"""Prefect flows: train and retrain.

Defaults set here, before Prefect is imported (the environment still wins):
- Prefect's server sends usage analytics; on an offline machine every command then prints a telemetry error.
- The product logs through ordinary module loggers (``logging.getLogger(__name__)``); Prefect attaches the
  ones named in PREFECT_LOGGING_EXTRA_LOGGERS to the flow run's logs, so training's and the store's lines
  reach the UI without a logger threaded through every call. A line logged outside a run (a background upload
  finishing after its unit) is simply not sent, instead of a warning each time.

A flow-run process started by a worker imports Prefect (and configures its logging) before it imports this
package, so the environment default comes too late there: ``ship_module_logs`` attaches the handler itself,
and every flow calls it first.
"""

import logging
import os

PRODUCT_LOGGERS = ("training", "checkpointing", "tasks", "flows")

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", ",".join(PRODUCT_LOGGERS))
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")


def product_logs_at_info() -> None:
    """The product's loggers at INFO unless set otherwise (Python's default, WARNING, would drop the unit lines).
    A flow-run process may run Prefect's logging set-up after this package was imported, which resets the levels
    of loggers it does not name: a flow that needs its lines calls this again when it starts."""
    for name in PRODUCT_LOGGERS:
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.INFO)


product_logs_at_info()


def ship_module_logs() -> None:
    """Sends the product's module loggers' lines (INFO and up) to the flow run's logs, once per process, whoever
    started it: a worker's flow-run process may run a flow unpickled from a bundle, without this module's import."""
    from prefect.logging.handlers import APILogHandler

    product_logs_at_info()
    # Prefect's own handler instances (what its logging set-up gives extra loggers): adding them twice is a no-op.
    handlers = [h for h in logging.getLogger("prefect.extra").handlers if isinstance(h, APILogHandler)]
    for name in PRODUCT_LOGGERS:
        logger = logging.getLogger(name)
        for handler in handlers or [APILogHandler()]:
            if not any(isinstance(h, APILogHandler) for h in logger.handlers) or handler in logger.handlers:
                logger.addHandler(handler)


# `python -m flows.train`: read the flags and start a temporary Prefect server before the heavy imports.
from flows.launch import begin as _begin  # noqa: E402

_begin()
