"""Background commits: training goes on while the previous checkpoint uploads.

The unit serializes its state (the only stall), hands the bytes here and keeps training. One commit
is in flight at most, so memory stays bounded at one serialized checkpoint. ``latest`` moves only when
the commit has written every file and the manifest; a process that dies mid-upload leaves ``latest``
on the previous checkpoint, and the torn folder has no manifest, so nothing torn is ever read.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from checkpointing.manifest import Writer
from checkpointing.store import CheckpointInfo, CheckpointStore

log = logging.getLogger(__name__)


class BackgroundCommitter:
    """Commits one checkpoint at a time on a background thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-upload")
        self._lock = threading.Lock()
        self._pending: Future | None = None
        self.pending_name: str | None = None
        self.pending_store_uri: str | None = None

    def submit(
        self,
        store: CheckpointStore,
        name: str,
        blobs: dict[str, bytes],
        *,
        progress: dict[str, int],
        metadata: dict[str, Any],
        writer: Writer,
        keep: int = -1,
        score: tuple[str, str] | None = None,
    ) -> None:
        """Starts committing ``blobs``; first waits for (and re-raises the failure of) the previous one."""
        self.wait()
        with self._lock:
            self.pending_name, self.pending_store_uri = name, store.uri
            self._pending = self._pool.submit(self._commit, store, name, blobs, progress, metadata, writer, keep, score)

    def wait(self) -> CheckpointInfo | None:
        """Blocks until the commit in flight (if any) is done; re-raises its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        finally:
            self.pending_name = self.pending_store_uri = None

    def wait_quietly(self) -> CheckpointInfo | None:
        """Like ``wait`` but logs a failure instead of raising (a retry will resume from what committed)."""
        try:
            return self.wait()
        except Exception as exc:
            log.warning(
                "background commit failed: %s: %s; resuming from the last committed checkpoint", type(exc).__name__, exc
            )
            return None

    @staticmethod
    def _commit(
        store: CheckpointStore,
        name: str,
        blobs: dict[str, bytes],
        progress,
        metadata,
        writer,
        keep: int,
        score: tuple[str, str] | None,
    ) -> CheckpointInfo:
        t0 = time.perf_counter()
        info = commit_and_prune(
            store, name, blobs, progress=progress, metadata=metadata, writer=writer, keep=keep, score=score
        )
        log.info(
            "checkpoint %s committed in the background: %.1f MB in %.2fs",
            name,
            info.size_bytes / 1e6,
            time.perf_counter() - t0,
        )
        return info


def commit_and_prune(
    store: CheckpointStore,
    name: str,
    blobs: dict[str, bytes],
    *,
    progress: dict[str, int],
    metadata: dict[str, Any],
    writer: Writer,
    keep: int = -1,
    score: tuple[str, str] | None = None,
) -> CheckpointInfo:
    """Commits a checkpoint, then applies retention with the same store (which knows what is in flight).
    ``score`` is (metric, "max" or "min") for keep-best retention."""
    info = store.commit(name, blobs, progress=progress, metadata=metadata, writer=writer)
    if keep > 0:
        attribute, order = score or (None, "max")
        store.prune(keep, attribute, order)
    return info
