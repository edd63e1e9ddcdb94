"""What one process keeps across units and runs, in one list, and ``reset()``, which forgets all of it.

A unit task's process outlives its units: Prefect retries a task in the same process, and the next unit of a run
(or the next run, in a worker) finds there what the last one left. Most of that is kept on purpose — a warm session
instead of a download, the gang's ranks instead of a fresh torchrun — and each module that keeps something forgets
it on its own terms. A test is a fresh process in miniature: ``reset()`` gives it one, whatever the previous test
left behind (tests/conftest.py calls it around every test).
"""

from __future__ import annotations

from collections.abc import Callable


def reset() -> None:
    """Forgets everything this process keeps across units and runs, as if it had just started."""
    for forget in _forgetters():
        forget()


def _forgetters() -> list[Callable[[], None]]:
    """How to forget each thing the process keeps, in the order they are forgotten: the gang's ranks first (they
    run units), the roots a deployment run confined this process to last."""
    from checkpointing.commit import snapshots
    from checkpointing.io import confine
    from training import preemption
    from training.distributed.gang import close_gangs
    from training.metrics import log as metrics_log
    from training.recipe import loader
    from training.start import preflight, warm_start
    from training.unit import rng
    from training.unit.loop import BUDGETS
    from training.unit.warm import PROCESS

    return [
        close_gangs,  # torchrun's ranks kept for an attempt's units (training/distributed/gang.py)
        PROCESS.forget,  # the last unit's live session (training/unit/warm.py)
        PROCESS.committer.drop_snapshots,  # the run's snapshot slots and threads (checkpointing/commit/snapshots.py)
        snapshots.close_all,  # any other committer's pipeline still open: its threads and agent
        BUDGETS.clear,  # each run's save times, for the grace budget of a stop (training/unit/loop.py)
        preemption.STOP.clear,  # a pending stop request, and the signals ignored after it
        rng.disown_python_random,  # ``random``'s functions routed by thread, training's thread (training/unit/rng.py)
        loader._allowed_in_process.clear,  # recipes a command line allowed for itself (``allow_recipe``)
        loader.installed_recipes.cache_clear,  # the installed packages' recipe entry points, read once
        preflight._passed.clear,  # configs whose recipe was already built once (training/start/preflight.py)
        warm_start._passed.clear,  # load_paths already checked against the recipe (training/start/warm_start.py)
        metrics_log.close_all,  # the runs' TensorBoard writers and MLflow runs (training/metrics/log.py)
        confine._state.clear,  # the local roots a deployment run confined this process to (checkpointing/io/confine.py)
    ]
