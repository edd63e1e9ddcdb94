"""A sweep's trial, in the process of its own that the trial task starts: ``python -m flows.sweep_trial <spec>``.

Not a command for people: the spec file is written by tasks/trial.py (in a private temporary folder) and names the
trial's run configuration and where to leave the result. The run is the ordinary training flow (flows/train.py: its
own flow run, retries, snapshots, preemption), run the way the command line runs it (one line and exit 143 on a
stop request, 2 for a refused configuration, 1 for a failure). Unlike ``python -m flows.train``, naming a recipe here
allows nothing: the recipe must be one this worker allows (the sweep, already checked, passes the one it was allowed
to run in the environment), and a trial of a deployment run's sweep is opened as untrusted (flows/restarts.py).

``python -m flows.sweep_trial <spec> --warm`` is a warm runner (tasks/trial_runner.py): the same segment, many times
over in one process, each handed over on stdin and reported by a mark line on stderr with the exit code above.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
import traceback
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
    from tasks.trial_runner import WARM_FLAG

    if len(argv) == 2 and argv[1] == WARM_FLAG:
        return serve(argv[0])
    if len(argv) != 1:
        return cli.fail("usage: python -m flows.sweep_trial <spec file written by the sweep's trial task>", 2)
    cli.exit_code = run_segment(argv[0])
    return cli.exit_code


def run_segment(spec_file: str) -> int:
    """The segment the spec file names, run to its end: the command line's exit code."""
    from flows.train import done_line, train
    from training.config import TrainConfig

    with open(spec_file) as f:
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

    from tasks.trial import TRIAL_TAG

    with tags(str(spec.get("tag") or TRIAL_TAG)):  # the trial task ends this flow run if the process dies
        return cli.run_checked(train, config, {}, done, verbose=False)


def serve(spec_file: str) -> int:
    """A warm runner (tasks/trial_runner.py): one segment per ``run`` line on stdin, each from a process reset to
    how it started (training/process_state.py), each ended by the mark line on stderr with its exit code; stdin's
    EOF (the sweep closed it, or died) ends the runner."""
    import flows.train  # noqa: F401  # what every segment imports, imported before the first freeze
    from tasks.trial_runner import DONE_MARK
    from training import process_state
    from training.start import phases

    # Ctrl-C reaches the whole process group: a segment turns it into a stop request (cli.run_checked's handlers); an
    # idle runner has nothing to stop and ends when the sweep closes its stdin, without a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()  # the imports' objects (the first settle: what they left as garbage is next to nothing)
    segments = 0
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        clock = phases.handed_over()  # the run's start-up line counts from here (training/start/phases.py)
        process_state.reset()  # the previous segment's warm session, stop request, caches, allowed recipes...
        segments += 1
        if segments == 2:  # what the first segment imported (the recipe's modules, its data's libraries) too
            settle()
        clock.mark("reset")
        try:
            code = run_segment(spec_file)
        except Exception as exc:  # what a fresh process would have died of: its traceback, exit 1
            traceback.print_exc()
            code = cli.fail(f"trial segment did not run: {type(exc).__name__}: {exc}", 1)
        _flush_prefect_logs()
        sys.stdout.flush()
        sys.stderr.write(f"{DONE_MARK} {code}\n")
        sys.stderr.flush()
    cli.exit_code = 0
    return 0


def settle() -> None:
    """Moves every object alive now out of the cyclic garbage collector's sight (``gc.freeze``), once the imports are
    done: the reset between segments collects garbage (training/unit/warm.py), and a full collection over the ~500,000
    objects of torch's, Prefect's and a recipe's modules took 0.2-0.5 s per segment, for garbage that is all the
    segment's own. Done at the runner's start (without a collection: its imports left next to no garbage) and here,
    once after its first segment (reset by then, so what it leaves alive is what any later segment finds too).
    Objects frozen are still freed when nothing refers to them; only a reference cycle among them that becomes
    garbage later is kept, once, not per segment."""
    gc.collect()
    gc.freeze()


def _flush_prefect_logs() -> None:
    """The segment's flow-run logs reach the API before the sweep hears it ended (a fresh process flushed them at
    exit); a failure to ship is Prefect's own warning, never the segment's outcome."""
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5, at_exit=False)
    except Exception:
        return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
