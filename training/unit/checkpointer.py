"""The one training-side commit: a unit's checkpoint, a ``train_loop`` report, FSDP shards, a preemption checkpoint.

What every commit of a run shares is decided here once: the manifest's metadata, the writer (fenced by its
generation), the retention, and whether the upload goes to the background while training goes on. The state is
snapshotted here and handed to the one commit path below (checkpointing/commit/), and the caller gets back what
was committed and how long training stalled for it; the caller's metrics are never touched. When several processes
train, rank 0 commits and every rank learns the result, or rank 0's error (``ranks.on_rank0``); with FSDP every
rank writes its own shards.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpointing import CheckpointStore, Writer, ranks
from checkpointing.commit import agent
from checkpointing.commit import committer as commits
from checkpointing.commit.agent import Agent
from checkpointing.commit.committer import INTERMEDIATE, Committer, CommitTerms, PendingCommit
from checkpointing.commit.snapshots import SnapshotPipeline, Stats, Taken
from checkpointing.host_tier.gc import claim_of, sweep_on_open
from checkpointing.host_tier.tier import HostTier, TierUnavailable
from checkpointing.names import checkpoint_name
from checkpointing.store import STATE_FILE
from training.config import TrainConfig
from training.position.iterable import StatefulIterable
from training.start.identity import run_identity
from training.start.store import retention, store_retry
from training.unit import rng
from training.unit.session import SINGLE_PROCESS, UNIT_SO_FAR, Session, World, rng_file
from training.unit.state import SMALL

logger = logging.getLogger(__name__)

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
        # Snapshots: one pipeline, on rank 0 (DDP's state is the same on every rank; RNG states are gathered to it).
        # FSDP: every rank snapshots its own shards, into host memory only (the store gets the unit's sharded
        # checkpoint, which all ranks write together).
        self.sharded = config.parallelism == "fsdp"
        self.snapshots = self._pipeline() if world.rank == 0 or self.sharded else None
        self._claim: dict[str, Any] | None = None
        self._run: dict[str, Any] | None = None  # what every manifest of the run says of it (``metadata``)
        self._figures = Stats()  # this unit attempt's snapshots inside the unit (a Checkpointer lives one attempt)

    def save(self, s: Session, metrics: Mapping[str, float]) -> Saved:
        """A unit's checkpoint: the session's state bundle, its progress and every rank's RNG state. Every rank calls
        it; ``metrics`` (the unit's) go into the manifest."""
        if self.config.parallelism == "fsdp":
            return self._save_shards(s, metrics)
        s.rng_state = self._rank_state(s)
        rng_states = ranks.gather_to_rank0(s.rng_state)  # on rank 0; elsewhere empty, and only rank 0 snapshots

        def snapshot() -> dict[str, Any]:
            return unit_objects(s, s.progress.as_dict(), rng_states)

        self._hook(s)
        return self._commit(s.progress.as_dict(), snapshot, self.metadata(metrics, s))

    def _rank_state(self, s: Session) -> dict[str, Any]:
        """This rank's RNG state and, for a stateful stream, its position (training/position/iterable.py)."""
        state = rng.capture()
        if isinstance(s.dataset, StatefulIterable):
            state["data"] = s.dataset.capture(self.world.size, self.config.global_batch_size, self.config.num_workers)
        return state

    def snapshot(self, s: Session, metrics: Mapping[str, float]) -> float | None:
        """A snapshot inside a unit (``snapshot_interval``): into host memory now, to the store when the upload before
        it is done (FSDP: each rank's shards, into host memory only). Every rank calls it. Returns the stall: the whole
        call (the state's dicts, RNG, the copy), or None when snapshots fell back to the old way."""
        t0 = time.perf_counter()
        taken = self._snapshot(s, metrics)
        return None if taken is None else time.perf_counter() - t0

    def _snapshot(self, s: Session, metrics: Mapping[str, float]) -> float | None:
        if self.sharded:
            return self._snapshot_shards(s, metrics)
        # Not kept as s.rng_state: that is the unit end's, which a warm next unit restores.
        rng_states = ranks.gather_to_rank0(self._rank_state(s))  # on rank 0; elsewhere empty
        if not self._copies:  # another rank than 0 (or a state the slots cannot hold): nothing to copy
            return 0.0
        progress = s.progress.as_dict()
        objects = unit_objects(s, progress, rng_states)
        metadata = {**self.metadata(metrics, s), INTERMEDIATE: True}
        self._hook(s)
        try:
            return self._count(self._take(progress, objects, metadata, must_upload=False))
        except TypeError as exc:
            self._fall_back(exc)
            return None

    def _count(self, taken: Taken) -> float:
        self._figures.add(taken)
        return taken.seconds

    def snapshot_figures(self) -> dict[str, float]:
        """What this attempt's snapshots inside the unit cost the training thread, apart from their whole stall
        (``snapshot_seconds_max``): the longest copy and the longest wait for a buffer (being made in the background,
        or held by uploads that lag)."""
        f = self._figures
        if not f.taken:
            return {}
        return {"snapshot_copy_seconds_max": f.copy_seconds_max, "snapshot_wait_seconds_max": f.wait_seconds_max}

    def prepare(self, s: Session) -> None:
        """At a unit's start: the snapshot pipeline starts making its first buffer for this state in the background,
        while the unit's steps run (a unit's checkpoint and its snapshots copy into it). Sized by the state as it
        is: an optimizer that makes its state at its first step (Adam's two buffers per parameter) is sized after
        that step, not before, when the state is a third of its size. FSDP's shards only with ``snapshot_interval``
        (its unit checkpoints do not copy into slots)."""
        if self.snapshots is None or not self._copies or (self.sharded and self.config.snapshot_every is None):
            return
        if s.optimizer.state or not any(group["params"] for group in s.optimizer.param_groups):
            self._prepare_now(s)
            return
        hooks: list[Any] = []

        def after_first_step(*_: Any) -> None:
            hooks.pop().remove()
            self._prepare_now(s)

        hooks.append(s.optimizer.register_step_post_hook(after_first_step))

    def _prepare_now(self, s: Session) -> None:
        if self.snapshots is None:  # the run finished meanwhile
            return
        if self.sharded:
            objects = self._shard_objects(s, s.progress.as_dict())
        else:  # this rank's RNG state for every rank's (same sizes); a stream's position is small, and reading it
            # asks the loader's workers
            objects = unit_objects(s, s.progress.as_dict(), [rng.capture()] * self.world.size)
        self.snapshots.prepare(objects)

    def _snapshot_shards(self, s: Session, metrics: Mapping[str, float]) -> float | None:
        """parallelism='fsdp': this rank's shards, the small parts and its RNG state, into this machine's memory."""
        if not self._copies:
            return None
        progress = s.progress.as_dict()
        objects = self._shard_objects(s, progress)
        metadata = {**self.metadata(metrics, s), INTERMEDIATE: True, "parallelism": "fsdp"}
        self._hook(s)
        try:
            return self._count(self._take(progress, objects, metadata, must_upload=False, upload=False))
        except TypeError as exc:
            self._fall_back(exc)
            return None

    def _shard_objects(self, s: Session, progress: dict[str, Any]) -> dict[str, Any]:
        """What a snapshot of this rank's FSDP shards copies: the shards, the small parts and its RNG state."""
        from training.unit import fsdp

        return {
            fsdp.SHARDS_FILE: fsdp.local_shards(s.model, s.optimizer),
            fsdp.EXTRA_FILE: {**s.state.state_dict(SMALL), "progress": progress},
            fsdp.rank_extra_file(self.world.rank): rng.capture(),  # not s.rng_state (the unit end's, as above)
        }

    def finish(self) -> None:
        """The run is complete: its last checkpoint committed, its snapshots leave this machine's memory."""
        self.committer.wait()
        if self.snapshots is not None:
            self.snapshots.remove_tier()
            self.committer.drop_snapshots()  # and its buffers (page-locked ones too) go back to the machine
            self.snapshots = None

    def save_report(
        self,
        state: Mapping[str, Any],
        progress: dict[str, int],
        metrics: Mapping[str, float],
        report: int,
        rank_state: Mapping[str, Any] | None = None,
    ) -> Saved:
        """A ``train_loop`` report's ``state`` (rank 0's, when several train) at ``progress``: report number ``report``
        of the run, with every rank's RNG state and ``rank_state`` (if it gave one) in files of their own in the same
        checkpoint, as a unit's RNG states are. Every rank calls it."""
        full = {**progress, "global_batch_size": self.config.global_batch_size}
        metadata = {**self.metadata(metrics), "train_loop": True, "report": report}
        own = {"rng": rng.capture(), "state": None if rank_state is None else dict(rank_state)}
        everyone = ranks.gather_to_rank0(own)  # on rank 0; elsewhere empty, and only rank 0 snapshots

        def snapshot() -> dict[str, Any]:
            objects: dict[str, Any] = {STATE_FILE: {"state": dict(state), "progress": full}}
            for r, theirs in enumerate(everyone):
                objects[rng_file(r)] = theirs["rng"]
                if theirs["state"] is not None:
                    objects[rank_state_file(r)] = {"state": theirs["state"]}
            return objects

        return self._commit(full, snapshot, metadata)

    def metadata(self, metrics: Mapping[str, float], s: Session | None = None) -> dict[str, Any]:
        """What a checkpoint's manifest says of the run (``check_same_run`` reads it) besides the progress."""
        if self._run is None:  # once: the run's identity resolves the recipe through the entry points (~30 ms)
            config = self.config
            identity = run_identity(config)
            self._run = {
                "config": identity,
                "config_fingerprint": config.fingerprint(),
                "recipe": identity["recipe"],
                "global_batch_size": config.global_batch_size,
                "seed": config.seed,
            }
        return {
            **self._run,
            "world_size": s.world.size if s is not None else self.world.size,
            "data_skip_applied": s.data_skip_applied if s is not None else None,
            "metrics": {k: float(v) for k, v in metrics.items()},
            **({UNIT_SO_FAR: s.unit_so_far} if s is not None and s.unit_so_far else {}),
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
        """The stall training sees: a copy into host memory (then committed in the background; waited for here when
        uploads are not asynchronous), or, without snapshots, the serialization or the whole commit."""
        if self._copies:
            try:
                taken = self._take(progress, snapshot(), metadata, must_upload=True)
            except TypeError as exc:
                self._fall_back(exc)
            else:
                if self.background:
                    return Saved(taken.pending, taken.seconds)
                t0 = time.perf_counter()
                taken.pending.wait()
                return Saved(taken.pending, taken.seconds + time.perf_counter() - t0)
        t0 = time.perf_counter()
        terms = CommitTerms(self.store, progress, self.writer, metadata, self.retention)
        request = commits.request(
            terms, snapshot(), background=self.background, network_weights=self.config.save_network_weights
        )
        pending = self.committer.send(request)
        return Saved(pending, time.perf_counter() - t0)

    def _take(
        self,
        progress: dict[str, int],
        objects: dict[str, Any],
        metadata: dict[str, Any],
        must_upload: bool,
        upload: bool = True,
    ) -> Taken:
        assert self.snapshots is not None
        terms = CommitTerms(self.store, progress, self.writer, metadata, self.retention)
        # A snapshot inside a unit gets its store name when it is uploaded (naming reads the store); its record in host
        # memory keeps the plain one. A unit's must be known now: the unit reports it.
        name = self.store.name_for(progress, self.writer.generation) if must_upload else checkpoint_name(progress)
        if self._claim is None:
            self._claim = claim_of(self.store, self.writer.generation)
        return self.snapshots.take(
            objects,
            terms,
            name,
            must_upload=must_upload,
            upload=upload,
            network_weights=self.config.save_network_weights,
            claim=self._claim,
        )

    def _pipeline(self) -> SnapshotPipeline:
        key = (self.store.uri, self.world.rank, self.config.host_memory_tier)
        pipeline = self.committer.snapshot_pipeline(
            key, lambda: open_pipeline(self.store, self.world.rank, self.config)
        )
        assert isinstance(pipeline, SnapshotPipeline)
        return pipeline

    def _hook(self, s: Session) -> None:
        """The next ``optimizer.step()`` waits for a snapshot: on the GPU for its copy of what it changes, on the CPU
        for its publication (``SnapshotPipeline.before_step``). One hook per optimizer: a new pipeline's replaces an
        old one's (a warm session outlives a run)."""
        pipeline = self.snapshots
        if pipeline is None or getattr(s.optimizer, "_snapshot_hooked", None) is pipeline:
            return
        old = getattr(s.optimizer, "_snapshot_hook", None)
        if old is not None:
            old.remove()
        s.optimizer._snapshot_hook = s.optimizer.register_step_pre_hook(lambda *_: pipeline.before_step())  # type: ignore[attr-defined]
        s.optimizer._snapshot_hooked = pipeline  # type: ignore[attr-defined]

    @property
    def _copies(self) -> bool:
        """Whether checkpoints are copied into the pipeline's host buffers (else serialized on the training thread)."""
        return self.snapshots is not None and self.snapshots.copies_refused is None

    def _fall_back(self, exc: TypeError) -> None:
        """The state holds what host buffers cannot take (a sparse tensor, say): for the rest of the run, checkpoints
        are serialized on the training thread and still committed by the pipeline's upload thread, in order."""
        assert self.snapshots is not None
        self.snapshots.copies_refused = str(exc)
        logger.warning(
            "snapshots off for this run: %s; checkpoints are serialized on the training thread (and uploaded in the "
            "background where async_upload is on); snapshot_interval has no effect",
            exc,
        )

    def _save_shards(self, s: Session, metrics: Mapping[str, float]) -> Saved:
        """parallelism='fsdp': every rank writes its shards and its RNG state; rank 0 commits after all reported
        (manifest, then ``latest``), then applies retention."""
        from training.unit import fsdp

        t0 = time.perf_counter()
        terms = CommitTerms(self.store, s.progress.as_dict(), self.writer, self.metadata(metrics, s), self.retention)
        extra = {**s.state.state_dict(SMALL), "progress": s.progress.as_dict()}
        pending = fsdp.save_sharded(terms, s.model, s.optimizer, extra, rng.capture())
        return Saved(pending, time.perf_counter() - t0)


def rank_state_file(rank: int) -> str:
    """The file of a ``train_loop`` report that holds rank ``rank``'s ``rank_state``."""
    return f"rank-state-rank{rank}.pt"


def open_pipeline(store: CheckpointStore, rank: int, config: TrainConfig) -> SnapshotPipeline:
    """The snapshot pipeline of a run on this process: slots in the host-memory tier, or private ones."""
    tier = None
    if config.host_memory_tier:
        try:
            tier = HostTier(store.uri, rank)
        except TierUnavailable as exc:
            logger.warning("host-memory tier off for this run: %s; snapshots stay in private memory", exc)
    if tier is not None and rank == 0:
        sweep_on_open(tier)  # other runs' snapshots that no relaunch would resume from leave this machine's memory
    return SnapshotPipeline(store.uri, rank, tier, start_agent(store, rank, config) if tier is not None else None)


def start_agent(store: CheckpointStore, rank: int, config: TrainConfig) -> Agent | None:
    """The agent that commits rank 0's newest snapshot from the tier should this process die without closing the run
    (checkpointing/commit/agent.py), where a relaunch may run on another machine. Not for FSDP: a rank's snapshot
    holds its own shards only, and the store gets a unit's sharded commit."""
    if rank != 0 or config.parallelism == "fsdp" or not agent.reaches_other_machines(store.storage):
        return None
    return Agent.start(
        agent.orders(
            config.save_folder,
            config.run_name,
            config.storage_options,
            store_retry(config),
            rank,
            retention(config),
            config.save_network_weights,
        )
    )


def discard_host_snapshots(store: CheckpointStore, committer: Committer) -> None:
    """The run starts over or rolls back: snapshots in this machine's memory must not be resumed from."""
    committer.drop_snapshots()
    with contextlib.suppress(TierUnavailable):
        HostTier(store.uri).remove()


def unit_objects(s: Session, progress: dict[str, Any], rng_states: Sequence[Any]) -> dict[str, Any]:
    """A unit's checkpoint files (not FSDP's): the state bundle with its ``progress``, and rank r's RNG state (and
    stream position) in ``rng_file(r)``. What a unit checkpoint and a snapshot commit, and what the first snapshot
    buffer is sized for."""
    objects: dict[str, Any] = {STATE_FILE: {"state": s.state.state_dict(), "progress": progress}}
    objects.update({rng_file(r): state for r, state in enumerate(rng_states)})
    return objects


def use_async_upload(config: TrainConfig, store: CheckpointStore) -> bool:
    """Async upload overlaps the next unit's training; it needs the next unit in this same process."""
    if config.async_upload is not None:
        return config.async_upload
    return not (store.storage.is_local or store.storage.protocol == "memory")
