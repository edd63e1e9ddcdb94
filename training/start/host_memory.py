"""Resuming from the host-memory tier: the newest snapshot this machine holds for the run, when it is newer than the
store's newest and belongs to the store's own history.

A snapshot in ``/dev/shm`` (checkpointing/host_tier/tier.py) outlives the process that took it, and the store goes on
without it: another machine may have trained the run further, a roll-back or a start-over may have set the run back,
the store may even have been deleted and the run begun anew under the same name. So a snapshot is taken only when
all of these hold, and the store is used otherwise:

- it verifies (its record parses and its bytes match their checksums; a torn or damaged slot is skipped, and the
  one before it is tried);
- its writer's claim is still in the store as it was when the snapshot was taken (a deleted and re-created run
  folder has other claims);
- no writer newer than it committed to the store, and no roll-back newer than it was made;
- it is further along than the store's newest checkpoint (more samples seen, or as many and more steps).

A checkpoint the run meant to commit (a unit's, a stop's: not a snapshot inside a unit) that is in the tier and not
in the store lost its upload with the process. The relaunch commits it first, as it was recorded (``commit_unsent``,
from ``Run.open``: checked like the store's newest before the run is claimed, committed once it is; and from a unit's
cold start, for a retry in the same process): the store then says where the run stands, with that unit's own
metrics. Resumed from instead, a unit's end left the relaunch a unit of 0 steps that committed the same checkpoint
again with 0 samples, a train_loss of 0 and no evaluation (a sweep then decided on those).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from checkpointing import CheckpointStore, LoadedCheckpoint
from checkpointing.commit.committer import INTERMEDIATE, CommitTerms, finish, snapshot_request
from checkpointing.host_tier.gc import not_resumable, position
from checkpointing.host_tier.tier import HostTier, Record, TierUnavailable, verified
from checkpointing.manifest import Manifest, Writer
from checkpointing.store import CHECKPOINTS, CheckpointInfo
from training.config import TrainConfig
from training.recipe.loader import uses_own_loop
from training.start.store import retention

logger = logging.getLogger(__name__)

HOST_URI = "host-memory://"  # what a snapshot read from the tier names as its URI (it may not be in the store yet)


def newest_snapshot(
    config: TrainConfig, store: CheckpointStore, rank: int = 0, size: int = 1
) -> LoadedCheckpoint | None:
    """The run's newest snapshot in this machine's memory, loaded, when it should be resumed from (see above). Several
    processes (DDP: rank 0 takes the snapshots, every rank's RNG state included): rank 0 chooses, every rank reads that
    snapshot from rank 0's files, and it is used only if every rank could (ranks on another machine cannot)."""
    if not config.host_memory_tier:
        return None
    if size == 1:
        return _newest(store)
    from checkpointing import ranks

    mine = _newest(store) if rank == 0 else None
    name = ranks.on_rank0(lambda: mine.info.name if mine is not None else None)
    if name is None:
        return None
    if rank != 0:
        mine = _newest(store, name)
    return mine if _on_every_rank(mine is not None) else None


def sharded_snapshot(config: TrainConfig, store: CheckpointStore, rank: int, size: int) -> LoadedCheckpoint | None:
    """parallelism='fsdp': every rank's own snapshot of the same step, when every rank holds one that verifies, it
    was taken at this world size (a snapshot holds this rank's shards; only the store's checkpoints reshard) and rank
    0 finds it resumable (see above). Every rank calls it."""
    import torch.distributed as dist

    from checkpointing import ranks

    if not config.host_memory_tier:
        return None
    try:
        tier: HostTier | None = HostTier(store.uri, rank)
    except TierUnavailable as exc:
        logger.info("host-memory tier not read: %s", exc)
        tier = None
    try:
        records = sorted(tier.records(rank), key=lambda r: r[1].seq, reverse=True) if tier else []
        mine = {record.name: (index, record) for index, record in records}
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, [r.name for _, r in records])
        common = [name for name in everyone[0] if all(name in names for names in everyone)]

        def choose() -> str | None:
            latest = store.latest() if common else None
            for name in common:  # newest first
                record = mine[name][1]
                why = not_resumable(store, record, latest)
                if not why and record.metadata.get("world_size") != size:
                    why = f"it was taken on {record.metadata.get('world_size')} process(es), this run has {size}"
                if why:
                    logger.info("host-memory snapshot %s not used: %s", name, why)
                    return None
                return name
            return None

        chosen = ranks.on_rank0(choose)
        objects = verified(tier, *mine[chosen], rank) if chosen is not None and tier is not None else None
        if chosen is None or not _on_every_rank(objects is not None):
            return None
        assert objects is not None
        return LoadedCheckpoint(_info(store, mine[chosen][1]), objects)
    finally:
        if tier is not None:
            tier.close()


def unsent_checkpoint(
    config: TrainConfig, store: CheckpointStore, latest: Callable[[], CheckpointInfo | None] | None = None
) -> LoadedCheckpoint | None:
    """The run's newest resumable state in this machine's memory (verified), when it is a checkpoint the run meant to
    commit (not a snapshot inside a unit) and the store never got it; None otherwise (a snapshot inside a unit stays
    where it is: the unit resumes from it). Reads only. Not for a loop of its own (its ``ctx.get_checkpoint()`` commits
    the report it resumes from memory: training/unit/own_loop.py) nor FSDP (a rank's snapshot holds its shards only)."""
    if not config.host_memory_tier or config.parallelism == "fsdp" or uses_own_loop(config):
        return None
    loaded = _newest(store, unit_ends_only=True, latest=latest)
    if loaded is None:
        return None
    at = store.storage.uri(f"{CHECKPOINTS}/{loaded.info.name}")  # where it will be: what the start-up checks name
    return LoadedCheckpoint(CheckpointInfo(loaded.info.name, at, loaded.info.manifest), loaded.objects)


def commit_unsent(
    config: TrainConfig, unsent: LoadedCheckpoint, store: CheckpointStore, writer: Writer
) -> CheckpointInfo | None:
    """Commits ``unsent`` (``unsent_checkpoint``'s) as it was recorded, metadata and metrics included, through the one
    commit path, by ``writer``: the attempt that holds the run's claim now, which names it (the store's rule: its
    position, plus ``-g<generation>`` where an older writer's checkpoint has that name, a roll-back's say). None when
    the store has it by now (the checkpoint agent of the process that died commits it too, and a relaunch here waits
    for the agent's lease)."""
    info = unsent.info
    latest = store.latest()  # the checkpoint agent of the process that died may have committed it while we claimed
    if latest is not None and position(latest.progress) >= position(info.progress):
        return None
    terms = CommitTerms(store, dict(info.progress), writer, dict(info.manifest.metadata), retention(config))
    name = store.name_for(dict(info.progress), writer.generation)  # named by its writer: -g<n> beside an older one
    request = snapshot_request(terms, name, unsent.objects, network_weights=config.save_network_weights)
    committed = finish(request, drop_superseded=True)
    logger.info(
        "checkpoint %s was in this machine's memory only (the process that took it died before its upload landed): "
        "committed to the store as it was recorded",
        committed.name,
    )
    return committed


def _newest(
    store: CheckpointStore,
    name: str | None = None,
    unit_ends_only: bool = False,
    latest: Callable[[], CheckpointInfo | None] | None = None,
) -> LoadedCheckpoint | None:
    """Rank 0's newest resumable snapshot (or the one called ``name``) that verifies; with ``unit_ends_only``, None
    when that snapshot is one inside a unit (before its bytes are read)."""
    try:
        tier = HostTier(store.uri)
    except TierUnavailable as exc:
        logger.info("host-memory tier not read: %s", exc)
        return None
    try:
        records = sorted(tier.records(0), key=lambda r: r[1].seq, reverse=True)
        newest = (latest or store.latest)() if records else None
        for index, record in records:
            if name is not None and record.name != name:
                continue
            why = not_resumable(store, record, newest)
            if why:
                logger.info("host-memory snapshot %s not used: %s", record.name, why)
                return None  # the older ones are older still
            if unit_ends_only and record.metadata.get(INTERMEDIATE):
                return None
            objects = verified(tier, index, record, 0)
            if objects is not None:
                return LoadedCheckpoint(_info(store, record), objects)
        return None
    finally:
        tier.close()


def _on_every_rank(ok: bool) -> bool:
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _info(store: CheckpointStore, record: Record) -> CheckpointInfo:
    writer = Writer(host="", pid=0, generation=record.generation)
    metadata = {k: v for k, v in record.metadata.items() if k != "claim"}
    manifest = Manifest(record.name, {}, dict(record.progress), metadata, writer, record.created_at)
    return CheckpointInfo(record.name, f"{HOST_URI}{store.uri}/{record.name}", manifest)
