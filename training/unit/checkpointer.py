"""The one training-side commit: a unit's checkpoint, a ``train_loop`` report, FSDP shards, a preemption checkpoint.

What every commit of a run shares is decided here once: the manifest's metadata, the writer (fenced by its
generation), the retention, and whether the upload goes to the background while training goes on. The state is
snapshotted here and handed to the one commit path below (checkpointing/commit.py), and the caller gets back what
was committed and how long training stalled for it; the caller's metrics are never touched. When several processes
train, rank 0 commits and every rank learns the result, or rank 0's error (``ranks.on_rank0``); with FSDP every
rank writes its own shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpointing import CheckpointStore, Writer, ranks
from checkpointing import commit as commits
from checkpointing.commit import Committer, CommitTerms, PendingCommit, Retention
from checkpointing.store import STATE_FILE
from training.config import TrainConfig
from training.start.identity import run_identity
from training.unit import rng
from training.unit.session import SINGLE_PROCESS, Session, World, rng_file
from training.unit.state import SMALL

Snapshot = Callable[[], dict[str, Any]]  # file name -> object for torch.save, taken when the commit starts


@dataclass(frozen=True)
class Saved:
    """What a commit gave back: the checkpoint (committed, or uploading in the background) and the seconds training
    stalled for it (the whole commit unless it went to the background). Several processes: rank 0's, on every rank
    (FSDP: each rank's own, as each writes its shards)."""

    pending: PendingCommit
    seconds: float


class Checkpointer:
    """Commits a run's checkpoints from one process: ``save`` for a unit, ``save_report`` for a ``train_loop`` report."""

    def __init__(
        self,
        config: TrainConfig,
        store: CheckpointStore,
        committer: Committer,
        *,
        generation: int = 0,
        world: World = SINGLE_PROCESS,
    ) -> None:
        self.config, self.store, self.committer, self.world = config, store, committer, world
        self.writer = Writer.current(generation)
        self.retention = retention(config)
        self.background = use_async_upload(config, store) and world.size == 1  # it needs one process's next unit

    def save(self, s: Session, metrics: Mapping[str, float]) -> Saved:
        """A unit's checkpoint: the session's state bundle, its progress and every rank's RNG state. Every rank calls
        it; ``metrics`` (the unit's) go into the manifest."""
        if self.config.parallelism == "fsdp":
            return self._save_shards(s, metrics)
        s.rng_state = rng.capture()
        rng_states = ranks.gather_to_rank0(s.rng_state)  # on rank 0; elsewhere empty, and only rank 0 snapshots

        def snapshot() -> dict[str, Any]:
            objects: dict[str, Any] = {STATE_FILE: {"state": s.state.state_dict(), "progress": s.progress.as_dict()}}
            objects.update({rng_file(r): state for r, state in enumerate(rng_states)})
            return objects

        return self._commit(s.progress.as_dict(), snapshot, self.metadata(metrics, s))

    def save_report(
        self, state: Mapping[str, Any], progress: dict[str, int], metrics: Mapping[str, float], report: int
    ) -> Saved:
        """A ``train_loop`` report's ``state`` (rank 0's, when several train) at ``progress``: report number ``report``
        of the run. Every rank calls it."""
        full = {**progress, "global_batch_size": self.config.global_batch_size}
        metadata = {**self.metadata(metrics), "train_loop": True, "report": report}
        return self._commit(full, lambda: {STATE_FILE: {"state": dict(state), "progress": full}}, metadata)

    def metadata(self, metrics: Mapping[str, float], s: Session | None = None) -> dict[str, Any]:
        """What a checkpoint's manifest says of the run (``check_same_run`` reads it) besides the progress."""
        config = self.config
        identity = run_identity(config)
        return {
            "config": identity,
            "config_fingerprint": config.fingerprint(),
            "recipe": identity["recipe"],
            "global_batch_size": config.global_batch_size,
            "world_size": s.world.size if s is not None else self.world.size,
            "seed": config.seed,
            "data_skip_applied": s.data_skip_applied if s is not None else None,
            "metrics": {k: float(v) for k, v in metrics.items()},
        }

    # -- helpers ------------------------------------------------------------------------------------
    def _commit(self, progress: dict[str, int], snapshot: Snapshot, metadata: dict[str, Any]) -> Saved:
        """One process: snapshot and send. Several: rank 0 does, and waits for the commit; every rank gets the result."""
        if self.world.size == 1:
            return self._send(progress, snapshot, metadata)

        def on_rank0() -> tuple[Any, float]:
            saved = self._send(progress, snapshot, metadata)
            return saved.pending.wait(), saved.seconds

        info, seconds = ranks.on_rank0(on_rank0)
        return Saved(PendingCommit.of(info), seconds)

    def _send(self, progress: dict[str, int], snapshot: Snapshot, metadata: dict[str, Any]) -> Saved:
        """The stall training sees: the snapshot (serialized, for a background upload), and a commit made now."""
        t0 = time.perf_counter()
        terms = CommitTerms(self.store, progress, self.writer, metadata, self.retention)
        request = commits.request(
            terms, snapshot(), background=self.background, network_weights=self.config.save_network_weights
        )
        pending = self.committer.send(request)
        return Saved(pending, time.perf_counter() - t0)

    def _save_shards(self, s: Session, metrics: Mapping[str, float]) -> Saved:
        """parallelism='fsdp': every rank writes its shards and its RNG state; rank 0 commits after all reported
        (manifest, then ``latest``), then applies retention."""
        from training.unit import fsdp

        t0 = time.perf_counter()
        terms = CommitTerms(self.store, s.progress.as_dict(), self.writer, self.metadata(metrics, s), self.retention)
        extra = {**s.state.state_dict(SMALL), "progress": s.progress.as_dict()}
        pending = fsdp.save_sharded(terms, s.model, s.optimizer, extra, rng.capture())
        return Saved(pending, time.perf_counter() - t0)


def retention(config: TrainConfig) -> Retention:
    return Retention(config.num_checkpoints_to_keep, config.checkpoint_score_attribute, config.checkpoint_score_order)


def use_async_upload(config: TrainConfig, store: CheckpointStore) -> bool:
    """Async upload overlaps the next unit's training; it needs the next unit in this same process."""
    if config.async_upload is not None:
        return config.async_upload
    return not (store.storage.is_local or store.storage.protocol == "memory")
