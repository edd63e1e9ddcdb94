"""Resuming from the host-memory tier: the newest snapshot this machine holds for the run, when it is newer than the
store's newest and belongs to the store's own history.

A snapshot in ``/dev/shm`` (checkpointing/host_tier.py) outlives the process that took it, and the store goes on
without it: another machine may have trained the run further, a roll-back or a start-over may have set the run back,
the store may even have been deleted and the run begun anew under the same name. So a snapshot is taken only when
all of these hold, and the store is used otherwise:

- it verifies (its record parses and its bytes match their checksums; a torn or damaged slot is skipped, and the
  one before it is tried);
- its writer's claim is still in the store as it was when the snapshot was taken (a deleted and re-created run
  folder has other claims);
- no writer newer than it committed to the store, and no roll-back newer than it was made;
- it is further along than the store's newest checkpoint (more samples seen).
"""

from __future__ import annotations

import logging
from typing import Any

from checkpointing import CheckpointStore, LoadedCheckpoint
from checkpointing.host_tier import HostTier, Record, TierUnavailable
from checkpointing.manifest import Manifest, Writer
from checkpointing.store import CheckpointInfo
from training.config import TrainConfig

logger = logging.getLogger(__name__)

HOST_URI = "host-memory://"  # what a snapshot read from the tier names as its URI (it may not be in the store yet)


def claim_of(store: CheckpointStore, generation: int) -> dict[str, Any]:
    """What the store's claim of ``generation`` says of who made it (what a snapshot records, and is matched on)."""
    claim = store.fence.read(generation)
    return {"claimed_at": claim.claimed_at, "host": claim.host, "pid": claim.pid}


def newest_snapshot(config: TrainConfig, store: CheckpointStore, rank: int = 0) -> LoadedCheckpoint | None:
    """The run's newest snapshot in this machine's memory, loaded, when it should be resumed from (see above)."""
    if not config.host_memory_tier:
        return None
    try:
        tier = HostTier(store.uri, rank)
    except TierUnavailable as exc:
        logger.info("host-memory tier not read: %s", exc)
        return None
    try:
        records = sorted(tier.records(rank), key=lambda r: r[1].seq, reverse=True)
        if not records:
            return None
        latest = store.latest()
        for index, record in records:
            why = _not_resumable(store, record, latest)
            if why:
                logger.info("host-memory snapshot %s not used: %s", record.name, why)
                return None  # the older ones are older still
            objects = tier.load(index, record, rank)
            if objects is not None:
                return LoadedCheckpoint(_info(store, record), objects)
        return None
    finally:
        tier.close()


def _not_resumable(store: CheckpointStore, record: Record, latest: CheckpointInfo | None) -> str:
    if latest is not None and record.progress.get("samples_seen", 0) <= latest.progress.get("samples_seen", 0):
        return f"the store's {latest.name} is as far along"
    if latest is not None and latest.manifest.writer.generation > record.generation:
        return f"a newer writer (generation {latest.manifest.writer.generation}) committed {latest.name}"
    if any(rb.get("generation", 0) > record.generation for rb in store.rollbacks()):
        return "the run was rolled back after it was taken"
    if record.metadata.get("claim") != claim_of(store, record.generation):
        return f"the store no longer holds the claim of writer generation {record.generation} it was taken under"
    return ""


def _info(store: CheckpointStore, record: Record) -> CheckpointInfo:
    writer = Writer(host="", pid=0, generation=record.generation)
    metadata = {k: v for k, v in record.metadata.items() if k != "claim"}
    manifest = Manifest(record.name, {}, dict(record.progress), metadata, writer, record.created_at)
    return CheckpointInfo(record.name, f"{HOST_URI}{store.uri}/{record.name}", manifest)
