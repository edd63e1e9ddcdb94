"""A sweep's trial, in the process of its own that the trial task starts: ``python -m flows.sweep_trial <spec>``.

Not a command for people: the spec file is written by tasks/trial.py (in a private temporary folder) and names the
trial's run configuration and where to leave the result. The run is the ordinary training flow (flows/train.py: its
own flow run, retries, snapshots, preemption), run the way the command line runs it (one line and exit 143 on a
stop request, 2 for a refused configuration, 1 for a failure). Unlike ``python -m flows.train``, naming a recipe here
allows nothing: the recipe must be one this worker allows (the sweep, already checked, passes the one it was allowed
to run in the environment), and a trial of a deployment run's sweep is opened as untrusted (flows/restarts.py).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import TYPE_CHECKING

from flows import cli, launch

if TYPE_CHECKING:
    from flows.train import TrainResult


def write_result(result: TrainResult, path: str) -> None:
    """What the sweep reads back: how many units this launch trained and where it started (written whole, then
    renamed into place: a half-written file is never read)."""
    units_trained = sum(1 for unit in result.units if unit.steps > 0)
    temporary = f"{path}.part"
    with open(temporary, "w") as f:
        json.dump({"units_trained": units_trained, "started_from": result.started_from}, f)
    os.replace(temporary, path)


def main(argv: list[str]) -> int:
    # Registered before Prefect and torch import (and register theirs), so it runs last: once the logs are shipped
    # and the result is written, the interpreter's teardown of its modules (~1 s) is skipped, as for flows.train.
    atexit.register(launch.exit_without_teardown)
    from flows.train import done_line, train
    from training.config import TrainConfig

    if len(argv) != 1:
        return cli.fail("usage: python -m flows.sweep_trial <spec file written by the sweep's trial task>", 2)
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        config = TrainConfig(**spec["config"])
    except cli.CONFIG_ERRORS as exc:
        return cli.fail(cli.config_error(exc, []), 2)
    result_file = str(spec["result_file"])

    def done(result: TrainResult) -> str:
        write_result(result, result_file)
        return done_line(result)

    from prefect import tags

    with tags(str(spec.get("tag") or "sweep-trial")):  # the trial task ends this flow run if the process dies
        cli.exit_code = cli.run_checked(train, config, {}, done, verbose=False)
    return cli.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
