"""A task run stopped on request finishes with an INFO line, not Prefect's ERROR.

Prefect's task engine logs "Finished in state ..." at ERROR for every final state but Completed, so a polite
preemption's unit (Cancelled, named ``Preempted`` or ``Superseded``: tasks/train_unit.py) printed an ERROR line at
the terminal and in the run's logs beside the one line that says where the run stopped (docs/preemption.md). A
Failed or Crashed task run keeps its ERROR: only the states named here are lowered.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

TASK_RUNS = "prefect.task_runs"  # the logger of Prefect's task engine (prefect.logging.loggers.task_run_logger)


class StoppedFinishIsInfo(logging.Filter):
    """Lowers the task engine's "Finished in state <name>(...)" from ERROR to INFO for the stop states ``names``."""

    def __init__(self, names: Iterable[str]):
        super().__init__()
        self.prefixes = tuple(f"Finished in state {name}(" for name in names)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).startswith(self.prefixes):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def install(names: Iterable[str]) -> None:
    """Adds the filter to the task engine's logger, once per process."""
    logger = logging.getLogger(TASK_RUNS)
    if not any(isinstance(f, StoppedFinishIsInfo) for f in logger.filters):
        logger.addFilter(StoppedFinishIsInfo(names))
