"""The first milliseconds of ``python -m flows.train``: what it does before torch, Prefect and the recipe import.

Importing them takes ~2 s here and the pre-flight ~1 s more, while a temporary Prefect server takes 2-15 s to
start: done one after the other, a run without a running server paid both. So the command, from the package's
``__init__`` (the first code ``python -m flows.train`` runs), first reads its flags (``--help`` answers here and
a configuration mistake ends here, with one line, exit code 2, nothing started), then runs the checks that need only
the run folder (a recipe not allowed, a relaunch with another model or data order: training/start/launch_checks.py;
they import torch, ~1-2 s, but no server is started for a launch they refuse: tests/integration/test_preflight.py),
then starts the temporary server (flows/server.py) as a child process and goes on importing; ``prefect_api`` adopts the server when the flow needs
it. Nothing here runs for ``import flows...`` in a program, in a test or in a flow-run process: only when this
interpreter was started as ``python -m flows.train`` or ``python -m flows.retrain`` (whose own flags are in
flows/options.py, light too).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.config import TrainConfig

COMMANDS = ("flows.train", "flows.retrain", "flows.sweep")
_SHORT_FLAGS = re.compile(r"^-[bBdEiIOPqsSuvx]*m(.*)$")  # python's flags without an argument, then -m


def command_module(orig_argv: list[str]) -> str | None:
    """The module of ``python [options] -m MODULE ...`` (``sys.orig_argv``), or None for a script or ``-c``."""
    args = iter(orig_argv[1:])
    for arg in args:
        if arg in ("-X", "-W", "--check-hash-based-pycs"):
            next(args, None)
            continue
        m = _SHORT_FLAGS.match(arg)
        if m:
            return m.group(1) or next(args, None)
        if arg in ("-c", "-") or not arg.startswith("-"):
            return None
    return None


def begin() -> None:
    """Called by ``flows/__init__.py``; acts only while ``python -m flows.train`` (or retrain) is starting."""
    if sys.argv[:1] != ["-m"]:  # runpy sets argv[0] to the module's path once the package has been imported
        return
    module = command_module(getattr(sys, "orig_argv", []))
    if module in COMMANDS:
        start(module, sys.argv[1:])


def start(module: str, argv: list[str]) -> None:
    """What command ``module`` with flags ``argv`` does first: answer ``--help`` or a configuration mistake and
    exit, else start the temporary server unless a Prefect server is configured or running."""
    atexit.register(exit_without_teardown)  # registered first: runs after every other exit handler
    from checkpointing import CheckpointError, StorageError
    from flows import cli, server
    from flows.options import RetrainOptions, sweep_options

    argv = [a for a in argv if a not in cli.VERBOSE_FLAGS]
    try:
        options = RetrainOptions if module == "flows.retrain" else sweep_options() if module == "flows.sweep" else None
        own, config = cli.parse(argv, options)  # --help prints and exits 0 here
        if module == "flows.sweep":  # the search space and the budget's units too, before a server starts
            from training.sweep.config import SweepConfig

            SweepConfig(train=config, **own)
        check_before_server(module, config)
    except cli.CONFIG_ERRORS as exc:
        sys.exit(cli.fail(cli.config_error(exc, argv), 2))
    except (CheckpointError, StorageError) as exc:
        sys.exit(cli.fail(f"run {config.run_name!r}: {exc}", 1))
    server.start_early()


def check_before_server(module: str, config: TrainConfig) -> None:
    """What refuses a launch from the configuration and the run folder alone (a recipe not allowed here, a relaunch
    that would continue the run with another model or data order or write over it): before a temporary server
    starts, so that such a refusal takes seconds (training/start/launch_checks.py; the run's start-up checks again).
    A sweep's trials have run folders of their own: only its recipe is checked here."""
    from training.start.launch_checks import check_launch, check_recipe_allowed

    if module == "flows.sweep":
        check_recipe_allowed(config)
    else:
        check_launch(config)


def exit_without_teardown() -> None:
    """Ends the command once every exit handler has run (logs and events shipped, the temporary server stopped,
    rank processes gone, files closed by their finalizers), skipping the interpreter's teardown of its modules:
    freeing torch's and Prefect's objects one by one took ~1 s here, after the result was printed (mypy's
    ``hard_exit`` does the same). Only for the exit code ``flows.cli.run`` returned to ``sys.exit``; an
    exception that escaped it exits the ordinary way."""
    cli = sys.modules.get("flows.cli")  # not imported here: at a --help or flag mistake `flows` is half-imported
    if cli is None or cli.exit_code is None:
        return
    try:
        logging.shutdown()  # registered before this handler, so it would run after it
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        return
    os._exit(cli.exit_code)
