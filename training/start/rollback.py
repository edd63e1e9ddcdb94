"""``resume_from``: roll a run back to one of its checkpoints, once.

The store records a roll-back under ``rollbacks/<generation>.json``; checkpoints that got further than
its target stop being candidates and stay where they are. The record also makes the option idempotent:
a flow run restarted after a crash, or launched again with the same parameters, finds that the run's
most recent roll-back already went to ``resume_from`` and continues from the newest checkpoint instead
of setting aside what was trained since. (To go back to the same checkpoint a second time, start a new run
from it with ``load_path``.) A checkpoint that a roll-back set aside cannot be rolled back to: the record that
set it aside still holds.
"""

from __future__ import annotations

import logging

from checkpointing import CheckpointStore, NotACheckpointError, Writer
from training.config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)
_LISTED = 5


def pending_roll_back(config: TrainConfig, store: CheckpointStore) -> str | None:
    """The checkpoint ``resume_from`` still has to roll the run back to, or None (unset, or already applied).

    Checked before the flow claims or writes anything: a name that is no checkpoint of the run, or one whose
    files are missing or of the wrong size, is a ConfigError. (``roll_back`` then hashes every file.)"""
    target = config.resume_from
    if not target:
        return None
    last = max(store.rollbacks(), key=lambda r: r["generation"], default=None)
    if last is not None and last["to"] == target:
        logger.info(
            "resume_from=%s: already applied (roll-back by writer generation %d); continuing from the run's "
            "newest checkpoint",
            target,
            last["generation"],
        )
        return None
    info = store.info(target)
    if info is None:
        infos = store.list()
        set_aside = set(store.set_aside(infos))
        names = [i.name for i in reversed(infos) if i.name not in set_aside][:_LISTED]
        have = f"its newest: {', '.join(names)}" if names else "it has none"
        raise ConfigError(
            f"resume_from={target!r}: run {config.run_name!r} in {store.uri} has no checkpoint of that name "
            f"({have}; all of them: python -m checkpointing ls {store.uri})"
        )
    if store.set_aside([info]):
        raise ConfigError(
            f"resume_from={target!r}: an earlier roll-back set that checkpoint aside, and this run cannot resume "
            f"from it; start a new run from it with load_path={info.uri!r}"
        )
    problems = store.check(info)
    if problems:
        raise ConfigError(
            f"resume_from={target!r}: that checkpoint does not verify ({'; '.join(problems)}); pick another "
            f"(python -m checkpointing verify {store.uri})"
        )
    return target


def roll_back(store: CheckpointStore, target: str, generation: int) -> list[str]:
    """Rolls the run back to ``target`` as writer ``generation``; logs and returns what was set aside."""
    try:
        set_aside = store.roll_back(target, Writer.current(generation))
    except NotACheckpointError as exc:  # a file that changed since pending_roll_back looked at its size
        raise ConfigError(str(exc)) from exc
    later = ", ".join(set_aside) if set_aside else "none (it was the newest)"
    logger.info(
        "resume_from=%s: rolled run %s back; checkpoints that stop being candidates: %s (kept in %s, "
        "recorded under rollbacks/)",
        target,
        store.run_name,
        later,
        store.uri,
    )
    return set_aside
