"""The command line of the flows (``python -m flows.train``, ``python -m flows.retrain``).

One clear line for every mistake at the terminal, exit 2 for configuration, 1 for a run that did not
complete; the traceback stays in the Prefect logs (``--verbose`` prints it here too). A flow's parameters
besides ``config`` (retrain's ``--metric``, ...) are flags too, described by a small pydantic model. The recipe named
on the command line is allowed for this process: the person at the terminal chose it.

Ctrl-C is a stop like SIGTERM (training/preemption.py: a checkpoint at the next step, one line, exit 130), not a
KeyboardInterrupt that unwinds from wherever it lands (a commit's fsync) with a hundred lines of traceback; a second
Ctrl-C aborts at once, with one line too.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import CliSettingsSource, SettingsConfigDict, SettingsError

from checkpointing import CheckpointError, StorageError
from flows import server
from flows.server import prefect_api
from training import preemption
from training.config import ConfigError, TrainConfig, describe_error, load_config
from training.config.sources import BoundedCliSource
from training.config.text import short
from training.exceptions import UsageError
from training.preemption import INTERRUPTED, Preempted

VERBOSE_FLAGS = ("--verbose", "-v")
CONFIG_ERRORS = (ValidationError, SettingsError, ConfigError)
exit_code: int | None = None  # what the last ``run`` returned (flows/launch.py exits with it)
ABORTED = "aborted by Ctrl-C: the run resumes from its last committed checkpoint; run the same command again"


def run(
    flow: Callable[..., Any],
    argv: list[str],
    done: Callable[[Any], str],
    options: type[BaseModel] | None = None,
    check: Callable[[TrainConfig, dict[str, Any]], None] | None = None,
    subject: Callable[[TrainConfig, dict[str, Any]], str] | None = None,
) -> int:
    """Parses ``argv`` into a TrainConfig (and the flow's own ``options``, passed to it as keyword arguments),
    runs ``flow`` and prints ``done(result)``; returns the exit code. A temporary Prefect server that
    ``python -m flows.train`` started before its imports (flows/launch.py) is stopped if the run never gets to it."""
    global exit_code
    verbose = any(a in VERBOSE_FLAGS for a in argv)
    argv = [a for a in argv if a not in VERBOSE_FLAGS]
    try:
        checks = check or (lambda config, _: check_before_prefect(config))
        code = _run(
            flow, argv, done, options, verbose, checks, subject or (lambda config, _: f"run {config.run_name!r}")
        )
    except KeyboardInterrupt:  # Ctrl-C before the run could stop politely (start-up), or a second one
        code = fail(ABORTED, INTERRUPTED)
    finally:
        server.discard_early()
    exit_code = code
    return code


def parse(argv: list[str], options: type[BaseModel] | None = None) -> tuple[dict[str, Any], TrainConfig]:
    """The flow's own options and the TrainConfig of ``argv`` (``--help`` prints both and exits); raises one of
    ``CONFIG_ERRORS``. Imports neither torch nor Prefect: flows/launch.py calls it before they load."""
    own, argv = flow_options(options, argv)
    return own, load_config(argv)


def config_error(exc: Exception, argv: list[str]) -> str:
    """The message for one of ``CONFIG_ERRORS``, as the terminal shows it."""
    if isinstance(exc, ValidationError):
        lines = describe_error(exc)
        return lines if "\n" not in lines else f"invalid configuration:\n{lines}"
    if isinstance(exc, SettingsError):
        return _settings_error(exc, argv)
    return str(exc)


def check_before_prefect(config: TrainConfig) -> None:
    """What fails at once, before a flow run exists: a recipe that may not run here or whose arguments do not
    build, a load_path that does not fit the model, a launch that would continue the run with another model or data
    order, a resume_from that names no checkpoint of the run. Imports torch and the recipe (the temporary server,
    started already, comes up meanwhile). ``python -m`` ran the checks of the run folder before that server
    (flows/launch.py); they run again here for ``main(argv)`` called from Python."""
    from training.run import check_resumable
    from training.start.launch_checks import check_recipe_allowed, check_relaunch
    from training.start.preflight import preflight
    from training.start.rollback import pending_roll_back
    from training.start.store import open_store
    from training.start.warm_start import check_before_start

    check_recipe_allowed(config)
    epoch_size = preflight(config)  # a bad recipe or recipe_args fails before the flow run is created
    check_before_start(config)  # ... and so does a load_path that does not fit the model
    store = open_store(config)
    start = check_relaunch(config, store)  # ... and a launch that would continue the run with another model or data
    rollback_to = pending_roll_back(config, store) if config.resume_from else None  # ... and a bad resume_from
    if start is not None and not rollback_to:  # ... and progress counters that place the run outside its data
        check_resumable(config, start, epoch_size)


def _run(
    flow: Callable[..., Any],
    argv: list[str],
    done: Callable[[Any], str],
    options: type[BaseModel] | None,
    verbose: bool,
    check: Callable[[TrainConfig, dict[str, Any]], None],
    subject: Callable[[TrainConfig, dict[str, Any]], str],
) -> int:
    try:
        own, config = parse(argv, options)
    except CONFIG_ERRORS as exc:
        return fail(config_error(exc, argv), 2)
    try:
        check(config, own)
    except CONFIG_ERRORS as exc:
        return fail(config_error(exc, argv), 2)
    except (CheckpointError, StorageError) as exc:
        return fail(f"{subject(config, own)}: {exc}", 1)
    return run_checked(flow, config, own, done, verbose, subject(config, own))


def run_checked(
    flow: Callable[..., Any],
    config: TrainConfig,
    own: dict[str, Any],
    done: Callable[[Any], str],
    verbose: bool,
    subject: str = "",
) -> int:
    """Runs ``flow(config, **own)`` as the command line does once the configuration was read and checked: a stop
    request is one line and exit 143 (130 for Ctrl-C), a mistake one line and exit 2, a failure one line and exit 1.
    A sweep's trial process (flows/sweep_trial.py) runs its run through here too. ``subject`` names what ran in the
    one line (``run 'demo'``, ``sweep 'lr'``)."""
    subject = subject or f"run {config.run_name!r}"
    try:
        # A SIGTERM while Prefect starts: leave, saying so. Ctrl-C too, whatever preemption_signals says; from the
        # first signal until exit, the others are ignored (a second Ctrl-C aborts).
        with preemption.handling([*config.preemption_signals, "SIGINT"], hold=True, interactive=True):
            preemption.raise_if_requested()
            with prefect_api():
                preemption.raise_if_requested()
                if not verbose:
                    quiet_console_tracebacks()
                result = flow(config, **own)
    except Preempted as exc:
        code = preemption.exit_code(exc.stop)
        return fail(f"{subject} {exc.describe()}; run the same command again to resume", code)
    except UsageError as exc:  # a configuration, a report or a loop that cannot work: exit 2, as for a flag
        return fail(str(exc), 2)
    except (CheckpointError, StorageError) as exc:
        return fail(f"{subject}: {exc}", 1)
    except Exception as exc:
        hint = "" if verbose else " (the traceback is in the flow run's Prefect logs; --verbose prints it here)"
        return fail(f"{subject} did not complete: {type(exc).__name__}: {exc}{hint}", 1)
    print(done(result))
    return 0


def python() -> str:
    """The interpreter that runs this command, as a person would type it (``.venv/bin/python``, or its full path):
    a suggested follow-up command must work without activating anything."""
    exe = sys.executable
    rel = os.path.relpath(exe) if os.path.isabs(exe) else exe
    return rel if not rel.startswith("..") else exe


def flow_options(options: type[BaseModel] | None, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Takes the flags of ``options`` (a flow's parameters besides ``config``) out of ``argv``: their values,
    and the flags left for TrainConfig. ``--help`` lists both under the flow's own command, and exits."""
    if options is None:
        return {}, argv
    if any(a in ("-h", "--help") for a in argv):
        _print_help(options)
    names = {f"--{name}" for name in options.model_fields}
    own: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i].split("=", 1)[0] in names:
            taken = 1 if "=" in argv[i] else 2
            own += argv[i : i + taken]
            i += taken
        else:
            rest.append(argv[i])
            i += 1
    values = CliSettingsSource(options, cli_parse_args=own, cli_exit_on_error=False)()  # type: ignore[arg-type]
    return options.model_validate(values).model_dump(), rest


def _print_help(options: type[BaseModel]) -> None:
    """The help of TrainConfig's flags and the flow's own, under the flow's command; argparse then exits 0."""

    prog = str(options.model_config.get("cli_prog_name") or "")
    flags: Any = type(
        "FlowFlags",
        (TrainConfig, options),
        {"model_config": SettingsConfigDict(**{**TrainConfig.model_config, "cli_prog_name": prog})},
    )

    flags.__doc__ = inspect.cleandoc(options.__doc__ or "")
    BoundedCliSource(flags, cli_parse_args=["--help"])  # its help writes JSON flags and factory defaults readably


def _settings_error(exc: SettingsError, argv: list[str]) -> str:
    """pydantic-settings' parse errors name the field but not what it takes; JSON fields need an example."""
    m = re.match(r"Parsing error encountered for (\w+)", str(exc))
    if not m:
        return str(exc)
    field = m.group(1)
    given = next(
        (argv[i + 1] for i, a in enumerate(argv[:-1]) if a in (f"--{field}", f"--{field.replace('_', '-')}")), ""
    )
    return f"{field}={short(given)}: use a JSON object, e.g. --{field} '{{\"hidden\": 64}}'"


def fail(message: str, code: int) -> int:
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
