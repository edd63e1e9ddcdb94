"""What outlives one unit in a process: the last unit's live session and the background committer.

The state a unit leaves behind after a successful commit is kept here; the next unit in this process
reuses it instead of downloading the checkpoint it just wrote, but only while that checkpoint is still
the run's newest (or is its own upload in flight). A failed unit's state is dropped, never reused: a
Prefect retry runs in the same process and thread, so anything kept would leak into it.
"""

from __future__ import annotations

import gc
import logging

import torch

from checkpointing import CheckpointStore
from checkpointing.commit.committer import Committer
from training.config import TrainConfig
from training.unit import rng
from training.unit.session import SINGLE_PROCESS, Origin, Session, World, pick_device, requested_data_skip

logger = logging.getLogger(__name__)


class SessionCache:
    """One per process (``PROCESS``); tests and benchmarks make their own or call ``forget``."""

    def __init__(self) -> None:
        self.committer = Committer()
        self._session: Session | None = None
        self._key: tuple = ()

    @staticmethod
    def key(config: TrainConfig, store: CheckpointStore, name: str, world: World = SINGLE_PROCESS) -> tuple:
        return (
            store.uri,
            name,
            config.fingerprint(),
            config.global_batch_size,
            config.parallelism,
            world,
            str(pick_device(config, world)),
        )

    def peek(self, config: TrainConfig, store: CheckpointStore, name: str) -> Session | None:
        """The kept session if it is clean at checkpoint ``name`` of this run and config (not taken out)."""
        session = self._session
        if session is None or self._key != self.key(config, store, name, session.world):
            return None
        return session

    def take(
        self, config: TrainConfig, store: CheckpointStore, expected: str | None, world: World = SINGLE_PROCESS
    ) -> tuple[Session | None, Origin | None]:
        """Takes the kept session out for a unit, if it is the checkpoint the flow expects the unit to start
        from (``expected``, which the flow verified) and still the run's newest state."""
        session, key, self._session, self._key = self._session, self._key, None, ()
        if session is None or expected is None or key != self.key(config, store, expected, world):
            if session is not None:
                self.release(session)
            return None, None
        name, how = self.committer.in_flight(store.uri), "its upload is in flight"
        if name is None:
            latest = store.latest()
            name, how = (latest.name if latest else None), "not downloaded"
        same_options = session.data_skip_applied == requested_data_skip(config)
        if name is not None and key == self.key(config, store, name, world) and same_options and session.rng_state:
            rng.restore(session.rng_state)
            return session, Origin("memory", name, f"checkpoint {name} (in memory, {how})")
        self.release(session)
        return None, None

    def keep(self, config: TrainConfig, store: CheckpointStore, session: Session, name: str) -> None:
        self._session, self._key = session, self.key(config, store, name, session.world)

    def release(self, session: Session, collect: bool = True) -> None:
        """Drops a session's objects so that nothing of a failed attempt survives into a retry: ``collect`` also frees
        what they held in reference cycles now (a full ``gc.collect()``, ~0.2 s in a process with torch and Prefect)
        rather than when the collector next runs."""
        if self._session is session:
            self._session, self._key = None, ()
        session.model = session.optimizer = session.scheduler = session.forward_model = None  # type: ignore[assignment]
        session.loader = None  # its worker processes end with it
        if collect:
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def forget(self, collect: bool = True) -> None:
        """Drops the kept session (the next unit resumes from the store)."""
        if self._session is not None:
            self.release(self._session, collect)


PROCESS = SessionCache()
