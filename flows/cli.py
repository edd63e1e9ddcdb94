"""The command line of the flows (``python -m flows.train``, ``python -m flows.retrain``).

One clear line for every mistake at the terminal, exit 2 for configuration, 1 for a run that did not
complete; the traceback stays in the Prefect logs (``--verbose`` prints it here too). The recipe named
on the command line is allowed for this process: the person at the terminal chose it.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from checkpointing import CheckpointError, StorageError
from flows.server import prefect_api
from training.config import ConfigError, TrainConfig, describe_error, load_config
from training.preflight import preflight
from training.recipe import allow_recipe
from training.rollback import pending_roll_back
from training.session import open_store
from training.warm_start import check_before_start

VERBOSE_FLAGS = ("--verbose", "-v")


def run(flow: Callable[[TrainConfig], Any], argv: list[str], done: Callable[[Any], str]) -> int:
    """Parses ``argv`` into a TrainConfig, runs ``flow`` and prints ``done(result)``; returns the exit code."""
    verbose = any(a in VERBOSE_FLAGS for a in argv)
    argv = [a for a in argv if a not in VERBOSE_FLAGS]
    try:
        config = load_config(argv)
        if ":" in config.recipe:
            allow_recipe(config.recipe)
        preflight(config)  # a bad recipe or recipe_args fails before a Prefect server is even started
        check_before_start(config)  # ... and so does a load_path that does not fit the model
        if config.resume_from:  # ... and a resume_from that names no checkpoint of the run (reads only)
            pending_roll_back(config, open_store(config), logging.getLogger(__name__))
    except ValidationError as exc:
        lines = describe_error(exc)
        return _fail(lines if "\n" not in lines else f"invalid configuration:\n{lines}", 2)
    except SettingsError as exc:
        return _fail(_settings_error(exc, argv), 2)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except (CheckpointError, StorageError) as exc:
        return _fail(f"run {config.run_name!r}: {exc}", 1)
    try:
        with prefect_api():
            if not verbose:
                quiet_console_tracebacks()
            result = flow(config)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except (CheckpointError, StorageError) as exc:
        return _fail(f"run {config.run_name!r}: {exc}", 1)
    except Exception as exc:
        hint = "" if verbose else " (the traceback is in the flow run's Prefect logs; --verbose prints it here)"
        return _fail(f"run {config.run_name!r} did not complete: {type(exc).__name__}: {exc}{hint}", 1)
    print(done(result))
    return 0


def _settings_error(exc: SettingsError, argv: list[str]) -> str:
    """pydantic-settings' parse errors name the field but not what it takes; JSON fields need an example."""
    m = re.match(r"Parsing error encountered for (\w+)", str(exc))
    if not m:
        return str(exc)
    field = m.group(1)
    given = next(
        (argv[i + 1] for i, a in enumerate(argv[:-1]) if a in (f"--{field}", f"--{field.replace('_', '-')}")), ""
    )
    return f"{field}={given!r}: use a JSON object, e.g. --{field} '{{\"hidden\": 64}}'"


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


class _NoTraceback(logging.Formatter):
    """Formats a record as its inner formatter would, leaving out the traceback (kept for other handlers)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def quiet_console_tracebacks() -> None:
    """Prefect logs a failed task or flow with its traceback to the terminal (~40 lines before our one line);
    the API handler still sends it to the flow run's logs."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in logging.root.manager.loggerDict)]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _NoTraceback):
                handler.setFormatter(_NoTraceback(handler.formatter or logging.Formatter()))
