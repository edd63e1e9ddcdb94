"""Commits, now or in the background: training goes on while the previous checkpoint uploads.

A unit serializes its state (the only stall) and hands the bytes to a ``Committer``. With a background
upload, at most one commit is in flight, so memory stays bounded at one serialized checkpoint, and
``latest`` moves only when the commit has written every file and the manifest; a process that dies
mid-upload leaves ``latest`` on the previous checkpoint, and the torn folder has no manifest, so nothing
torn is ever read. Either way the caller gets a ``PendingCommit``, which says whether it is committed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from checkpointing.manifest import Writer
from checkpointing.store import CHECKPOINTS, CheckpointInfo, CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitRequest:
    """What to commit, and the retention to apply after it."""

    store: CheckpointStore
    name: str
    blobs: dict[str, bytes]
    progress: dict[str, int]
    metadata: dict[str, Any]
    writer: Writer
    keep: int = -1
    score: tuple[str, str] | None = None  # (metric, "max" | "min") for keep-best retention
    # Instead of ``blobs``, for a commit made now: the objects themselves, streamed into the store while they
    # are hashed (no serialized copy of the state in memory). A background commit needs the bytes: training
    # changes the objects meanwhile.
    objects: dict[str, Any] | None = None

    @property
    def uri(self) -> str:
        return self.store.storage.uri(f"{CHECKPOINTS}/{self.name}")

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.blobs.values())


@dataclass
class PendingCommit:
    """A checkpoint handed to the store: ``committed`` once its manifest and ``latest`` are written."""

    name: str
    uri: str
    size_bytes: int
    _future: Future[CheckpointInfo] = field(repr=False, default_factory=Future)

    @classmethod
    def of(cls, info: CheckpointInfo) -> PendingCommit:
        """An already committed checkpoint."""
        pending = cls(name=info.name, uri=info.uri, size_bytes=info.size_bytes)
        pending._future.set_result(info)
        return pending

    @property
    def committed(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def wait(self) -> CheckpointInfo:
        """Blocks until the commit is done; re-raises its error."""
        return self._future.result()


class Committer:
    """Commits checkpoints of one process: now (``commit``) or on a background thread (``submit``)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-upload")
        self._lock = threading.Lock()
        self._pending: PendingCommit | None = None
        self._pending_store_uri: str | None = None

    def commit(self, request: CommitRequest) -> PendingCommit:
        """Commits ``request`` before returning (after any commit still in flight)."""
        self.wait()
        return PendingCommit.of(_commit_and_prune(request))

    def submit(self, request: CommitRequest) -> PendingCommit:
        """Starts committing ``request`` in the background; first waits for (and re-raises) the previous one."""
        if request.objects is not None:
            raise ValueError("a background commit takes serialized blobs, not live objects")
        self.wait()
        pending = _pending(request)
        with self._lock:
            pending._future = self._pool.submit(_commit_in_background, request)
            self._pending, self._pending_store_uri = pending, request.store.uri
        return pending

    def in_flight(self, store_uri: str) -> str | None:
        """The name of the checkpoint of that store being uploaded now, if any."""
        with self._lock:
            pending = self._pending
            same_store = self._pending_store_uri == store_uri
        return pending.name if pending is not None and same_store and not pending._future.done() else None

    def wait(self) -> CheckpointInfo | None:
        """Blocks until the commit in flight (if any) is done; re-raises its error."""
        with self._lock:
            pending, self._pending, self._pending_store_uri = self._pending, None, None
        return pending.wait() if pending is not None else None

    def wait_quietly(self) -> CheckpointInfo | None:
        """Like ``wait`` but logs a failure instead of raising (a retry will resume from what committed)."""
        try:
            return self.wait()
        except Exception as exc:
            log.warning(
                "background commit failed: %s: %s; resuming from the last committed checkpoint",
                type(exc).__name__,
                exc,
            )
            return None


def _pending(request: CommitRequest) -> PendingCommit:
    return PendingCommit(name=request.name, uri=request.uri, size_bytes=request.size_bytes)


def _commit_in_background(request: CommitRequest) -> CheckpointInfo:
    t0 = time.perf_counter()
    info = _commit_and_prune(request)
    log.info(
        "checkpoint %s committed in the background: %.1f MB in %.2fs",
        request.name,
        info.size_bytes / 1e6,
        time.perf_counter() - t0,
    )
    return info


def _commit_and_prune(r: CommitRequest) -> CheckpointInfo:
    """Commits, then applies retention with the same store (which knows what is in flight)."""
    if r.objects is not None:
        from checkpointing.streaming import save_streaming

        info = save_streaming(r.store, r.name, r.objects, progress=r.progress, metadata=r.metadata, writer=r.writer)
    else:
        info = r.store.commit(r.name, r.blobs, progress=r.progress, metadata=r.metadata, writer=r.writer)
    if r.keep > 0:
        attribute, order = r.score or (None, "max")
        r.store.prune(r.keep, attribute, order)
    return info
