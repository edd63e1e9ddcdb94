"""``autoresume`` and ``save_overwrite`` when a run already has checkpoints: continue it, refuse, or start it over.

Composer refuses a launch that would write over a checkpoint file unless ``save_overwrite=True``. Here checkpoint
names carry the position (and a roll-back's retraining gets ``-g<generation>`` names), so a run that continues its
checkpoints never writes over one; the only launch that would is one that does not continue them
(``autoresume=False``). Such a launch is refused, as today, unless ``save_overwrite=True`` asks to start the run
over: then its checkpoints (and ``latest``, and its roll-back records) are deleted once this launch has claimed the
run, before it trains. A restart of that launch (a later attempt of the same flow run) continues what it trained.
"""

from __future__ import annotations

import logging

from checkpointing import CheckpointInfo, CheckpointStore, Writer
from checkpointing.pointer import POINTER
from checkpointing.rollbacks import ROLLBACKS
from training.config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)


def starts_over(
    config: TrainConfig, store: CheckpointStore, start: CheckpointInfo | None, attempt: int, in_memory: bool = False
) -> bool:
    """Whether this launch starts the run over (checked before anything is written); ConfigError when it would
    write over the run's checkpoints without save_overwrite. ``in_memory``: ``start`` is in this machine's memory only
    (its upload did not land: training/start/host_memory.py)."""
    if start is None:
        return False
    if config.autoresume:
        if config.save_overwrite:
            logger.warning(
                "save_overwrite=True changes nothing here: autoresume=True continues run %r from its checkpoint %s "
                "and never writes over a checkpoint; to start the run over set autoresume=False",
                config.run_name,
                start.name,
            )
        return False
    if attempt > 1:
        return False  # a restart of the launch that started over (or was refused): it continues what it trained
    if not config.save_overwrite:
        where = (
            f"(its newest, {start.name}, in this machine's memory: its upload to {store.uri} did not land)"
            if in_memory
            else f"in {store.uri}"
        )
        raise ConfigError(
            f"autoresume=False but run_name={config.run_name!r} already has checkpoints {where}; set "
            f"autoresume=True to continue it, save_overwrite=True to start it over (its checkpoints are deleted), "
            f"or choose a new run_name"
        )
    return True


def start_over(store: CheckpointStore, generation: int) -> list[str]:
    """Deletes the run's checkpoints, ``latest`` and roll-back records as writer ``generation`` (which has claimed
    the run: a stale writer is fenced off first); returns the names deleted. Claims stay: they fence writers."""
    store.check_fence(Writer.current(generation))
    names = [info.name for info in store.list()]
    for name in reversed(names):
        store.delete(name)
    for key, recursive in ((POINTER, False), (ROLLBACKS, True)):
        if store.storage.exists(key):
            store.storage.delete(key, recursive=recursive)
    logger.warning(
        "save_overwrite=True, autoresume=False: run %r starts over; deleted its %d checkpoint(s) in %s: %s",
        store.run_name,
        len(names),
        store.uri,
        ", ".join(names) or "none",
    )
    return names
