"""The checks that can refuse a launch from its configuration and the run folder alone, run before any server.

A relaunch with a changed configuration needs only the run folder's newest checkpoint to be refused; it used to be
refused after the temporary Prefect server had started and the flow's imports had loaded (103.6 s at load ~15, where
``python -m checkpointing ls`` answers in 1.6 s). ``python -m flows.train`` / ``flows.retrain`` / ``flows.sweep``
call these from flows/launch.py before the server starts, reading the run folder without claiming it; the run's own
start-up (``training.run.Run.open``) calls the same functions again, where the claim decides for good.
"""

from __future__ import annotations

import os

from checkpointing import CheckpointInfo, CheckpointStore
from checkpointing.io.protocols import is_local_fs, open_url
from training.config import ConfigError, TrainConfig
from training.recipe.loader import allow_recipe, resolve_recipe
from training.start.identity import check_same_run
from training.start.overwrite import starts_over


def check_recipe_allowed(config: TrainConfig, command_line: bool = True) -> None:
    """ConfigError when ``config.recipe`` may not run here. On the command line a ``module:Class`` path is allowed
    for this process (the person at the terminal chose it); a name must be one of the allowed ones."""
    if command_line and ":" in config.recipe:
        allow_recipe(config.recipe)
    resolve_recipe(config.recipe)


def check_relaunch(config: TrainConfig, store: CheckpointStore) -> CheckpointInfo | None:
    """The run's newest checkpoint (None for a new run), read without claiming the run; ConfigError when this
    launch would write over it without ``save_overwrite`` or continue it with another model or data order."""
    start = store.latest()
    if start is None:
        return None
    over = not config.autoresume and starts_over(config, store, start, attempt=1)  # autoresume=True: never over
    if not over:
        check_same_run(config, start)
    return start if config.autoresume else None


def check_launch(config: TrainConfig) -> None:
    """Both, as a launch from the command line runs them before a Prefect server is started or an API called."""
    check_recipe_allowed(config)
    store = CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options)
    if check_relaunch(config, store) is None:  # a new run (or one starting over): it starts from load_path
        check_load_path_exists(config)


def check_load_path_exists(config: TrainConfig) -> None:
    """ConfigError when a new run's ``load_path`` names nothing: a look at the path, no read (whether its weights fit
    the model is checked once torch and the recipe are imported, while the server starts). A run that resumes
    ignores load_path, so it is not looked at then."""
    if not config.load_path:
        return
    uri = str(config.load_path)
    fs, path = open_url(uri, config.storage_options)
    if not (os.path.lexists(path) if is_local_fs(fs) else fs.exists(path)):
        raise ConfigError(f"load_path={uri!r}: no such file or folder; fix the path, or leave load_path unset")
