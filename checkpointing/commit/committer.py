"""The commit's requests and its one end: every checkpoint — a unit's, a snapshot inside it, a ``train_loop`` report,
FSDP shards, a preemption checkpoint — is named, written, vouched for (files → manifest → ``latest``, fenced) and
pruned through ``finish`` here, whether the snapshot pipeline (snapshots.py) or the ``Committer`` sends it.

Training (its one caller, training/unit/checkpointer.py) hands over what to save (objects for ``torch.save``, or a
sharded state dict for DCP) and the ``CommitTerms``: where it stands (``progress``), the manifest's metadata, its
writer and the retention; only this package makes names (``CheckpointStore.name_for``) and manifests
(``CheckpointStore._publish``).

A commit is made now (streamed into the store while it is hashed: no serialized copy of the state in memory)
or in the background: the state is serialized (the only stall) and uploaded while training goes on. At most one
background commit is in flight, so memory stays bounded at one serialized checkpoint, and ``latest`` moves only
when the commit has written every file and the manifest; a process that dies mid-upload leaves ``latest`` on
the previous checkpoint, and the torn folder has no manifest, so nothing torn is ever read. Either way the
caller gets a ``PendingCommit``, which says whether it is committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from checkpointing.io.redact import redact_uri
from checkpointing.manifest import Writer
from checkpointing.serialization import serialize
from checkpointing.store import CHECKPOINTS, STATE_FILE, CheckpointInfo, CheckpointStore

log = logging.getLogger(__name__)

INTERMEDIATE = "within_unit"  # manifest metadata key: a snapshot taken inside a unit (see ``finish``)

# save_network_weights: the model's state_dict alone beside state.pt, under the same manifest (MindSpore's
# checkpoint_network copy, made a file of the checkpoint so that it is committed, verified and pruned with it)
WEIGHTS_FILE = "weights.pt"


@dataclass(frozen=True)
class Retention:
    """How many checkpoints a run keeps (-1: all), and by which reported metric the best are chosen."""

    keep: int = -1
    score_attribute: str | None = None
    score_order: str = "max"

    def apply(self, store: CheckpointStore) -> list[str]:
        return store.prune(self.keep, self.score_attribute, self.score_order) if self.keep > 0 else []


@dataclass(frozen=True)
class CommitTerms:
    """Everything of a commit but what it saves: the store, the progress (which names the checkpoint), the manifest's
    metadata, the writer (fenced by its generation) and the retention applied after it."""

    store: CheckpointStore
    progress: dict[str, int]
    writer: Writer
    metadata: dict[str, Any] = field(default_factory=dict)
    retention: Retention = Retention()


@dataclass(frozen=True)
class CommitRequest:
    """What to commit (named by the store from ``progress``), and the retention to apply after it."""

    store: CheckpointStore
    name: str
    progress: dict[str, int]
    metadata: dict[str, Any]
    writer: Writer
    retention: Retention = Retention()
    blobs: dict[str, bytes] = field(default_factory=dict)  # serialized files: what a background commit uploads
    # Instead of ``blobs``, for a commit made now: the objects themselves, streamed into the store while they
    # are hashed. A background commit needs the bytes: training changes the objects meanwhile.
    objects: dict[str, Any] | None = None

    @property
    def uri(self) -> str:
        return self.store.storage.uri(f"{CHECKPOINTS}/{self.name}")

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.blobs.values())


@dataclass
class PendingCommit:
    """A checkpoint handed to the store: ``committed`` once its manifest and ``latest`` are written. Carries
    the progress and metadata it was committed with, so a caller never has to read them back."""

    name: str
    uri: str
    size_bytes: int
    progress: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    _future: Future[CheckpointInfo] = field(repr=False, default_factory=Future)
    started: float = field(default_factory=time.monotonic)

    def when_committed(self, callback: Callable[[float], None]) -> None:
        """Calls ``callback(seconds)`` once the commit succeeded (at once if it has): seconds from the hand-over to
        the store to ``latest`` written, an upload in the background included."""

        def done(future: Future[CheckpointInfo]) -> None:
            if future.exception() is None:
                callback(time.monotonic() - self.started)

        self._future.add_done_callback(done)

    @classmethod
    def of(cls, info: CheckpointInfo) -> PendingCommit:
        """An already committed checkpoint."""
        pending = cls(info.name, info.uri, info.size_bytes, dict(info.progress), dict(info.manifest.metadata))
        pending.settle(info)
        return pending

    def settle(self, info: CheckpointInfo | None = None, error: BaseException | None = None) -> None:
        """Reports how the commit ended to whoever waits on it: committed as ``info``, or failed with ``error``. The
        engine that made the commit calls it once; a later call changes nothing."""
        if self._future.done():
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(info)  # type: ignore[arg-type]

    @property
    def committed(self) -> bool:
        return self._future.done() and self._future.exception() is None

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.metadata.get("metrics") or {})

    def wait(self) -> CheckpointInfo:
        """Blocks until the commit is done; re-raises its error."""
        return self._future.result()


def request(
    terms: CommitTerms, objects: dict[str, Any], *, background: bool, network_weights: bool = False
) -> CommitRequest:
    """The request for a checkpoint of ``objects`` (file name -> object for ``torch.save``) under ``terms``; with
    ``network_weights``, plus ``weights.pt``: the model state_dict of ``state.pt`` (``["state"]["model"]``) alone."""
    if network_weights:
        objects = with_network_weights(objects)
    return CommitRequest(
        store=terms.store,
        name=terms.store.name_for(terms.progress, terms.writer.generation),
        progress=dict(terms.progress),
        metadata=terms.metadata,
        writer=terms.writer,
        retention=terms.retention,
        blobs=serialize(objects) if background else {},  # a snapshot to upload while training goes on
        objects=None if background else objects,  # else streamed: no second copy of the state in memory
    )


def snapshot_request(terms: CommitTerms, name: str, objects: dict[str, Any], *, network_weights: bool) -> CommitRequest:
    """The commit of a snapshot from host memory (the upload thread's, or the checkpoint agent's after a death):
    ``objects`` streamed, plus ``weights.pt`` with ``network_weights``; a snapshot inside a unit (``INTERMEDIATE``) is
    named now, not when it was taken (naming reads the store). ``finish(..., drop_superseded=True)`` ends it."""
    if network_weights:
        objects = with_network_weights(objects)
    if terms.metadata.get(INTERMEDIATE):
        name = terms.store.name_for(terms.progress, terms.writer.generation)
    return CommitRequest(terms.store, name, dict(terms.progress), terms.metadata, terms.writer, terms.retention, {},
                         objects)  # fmt: skip


def land_and_close(pipeline: Background) -> None:
    """Lets a pipeline's uploads land (or fail, logged), then closes it."""
    try:
        pipeline.wait()
    except Exception as exc:
        log.warning("a snapshot upload failed: %s: %s", type(exc).__name__, exc)
    pipeline.close()


def with_network_weights(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` plus ``weights.pt`` holding ``state.pt``'s ``["state"]["model"]`` (the same tensors, written twice:
    a file that ``torch.load(f, weights_only=True)`` turns into a state_dict with no knowledge of this product)."""
    state = objects.get(STATE_FILE, {}).get("state") if isinstance(objects.get(STATE_FILE), dict) else None
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        log.warning(
            "save_network_weights: this checkpoint's state has no ['model'] state_dict; no %s written "
            "(a train_loop reports it as ctx.report(..., state={'model': model.state_dict(), ...}))",
            WEIGHTS_FILE,
        )
        return objects
    return {**objects, WEIGHTS_FILE: model}


def commit_sharded(terms: CommitTerms, state_dict: dict[str, Any], files: dict[str, Any]) -> PendingCommit:
    """Every rank calls it: DCP shards of ``state_dict`` plus this rank's ``files``, committed by rank 0 under the
    same protocol (see ``sharded.save_state``), then pruned by rank 0. Synchronous: the shards are written from the
    live model (DCP's async_save would need a staging copy, the memory this mode saves)."""
    from checkpointing import ranks
    from checkpointing.commit import sharded

    store, progress, writer = terms.store, terms.progress, terms.writer
    name = ranks.on_rank0(lambda: store.name_for(progress, writer.generation))
    info = sharded.save_state(
        store, name, state_dict, files=files, progress=progress, metadata=terms.metadata, writer=writer
    )
    if (ranks.group() or (0, 1))[0] == 0:
        terms.retention.apply(store)
    return PendingCommit.of(info)


class Background(Protocol):
    """The process's one background commit engine: the snapshot pipeline (snapshots.py) and its upload thread."""

    copies_refused: str | None

    def submit(self, request: CommitRequest) -> PendingCommit: ...
    def wait(self, timeout: float | None = None) -> None: ...
    def keep_newest(self) -> None: ...
    def in_flight(self) -> str | None: ...
    def close(self) -> None: ...


class Committer:
    """Commits checkpoints of one process: now, on the calling thread (``commit``), or in the background (``submit``)
    through the run's snapshot pipeline, whose upload thread is the process's one background commit path: a unit's
    copy in host memory and a checkpoint serialized on the training thread leave in the order they were taken."""

    def __init__(self) -> None:
        self.snapshots: Background | None = None  # the run's snapshot pipeline (snapshots.py)
        self._snapshots_key: tuple[Any, ...] = ()

    def snapshot_pipeline(self, key: tuple[Any, ...], make: Callable[[], Background]) -> Background:
        """The snapshot pipeline of ``key`` (a run and rank), made once; another run's is finished and closed first."""
        if self.snapshots is not None and self._snapshots_key != key:
            self.drop_snapshots()
        if self.snapshots is None:
            self.snapshots, self._snapshots_key = make(), key
        return self.snapshots

    def keep_newest_snapshot(self) -> None:
        """A unit failed in training: its newest snapshot must reach the store (see SnapshotPipeline.keep_newest)."""
        if self.snapshots is not None:
            self.snapshots.keep_newest()

    def drop_snapshots(self) -> None:
        """Lets the pipeline's uploads land (or fail, logged), then closes it."""
        pipeline, self.snapshots, self._snapshots_key = self.snapshots, None, ()
        if pipeline is not None:
            land_and_close(pipeline)

    def commit(self, request: CommitRequest) -> PendingCommit:
        """Commits ``request`` before returning (after any commit still in flight)."""
        self.wait()
        log.info("writing checkpoint %s to %s", request.name, redact_uri(request.store.uri))
        return PendingCommit.of(finish(request))

    def submit(self, request: CommitRequest) -> PendingCommit:
        """Hands ``request`` (serialized blobs) to the pipeline's upload thread; committed now without a pipeline."""
        if request.objects is not None:
            raise ValueError("a background commit takes serialized blobs, not live objects")
        if self.snapshots is None:
            return self.commit(request)
        return self.snapshots.submit(request)

    def send(self, request: CommitRequest) -> PendingCommit:
        """``submit`` for a request of serialized blobs, ``commit`` for one of live objects."""
        return self.commit(request) if request.objects is not None else self.submit(request)

    def in_flight(self, store_uri: str) -> str | None:
        """The name of the checkpoint of that store being uploaded now, if any."""
        if self.snapshots is not None and self._snapshots_key[:1] == (store_uri,):
            return self.snapshots.in_flight()
        return None

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the commits in flight (if any) are done; re-raises the error of one that failed. With
        ``timeout``, commits still in flight after that long raise TimeoutError and stay in flight."""
        if self.snapshots is not None:
            self.snapshots.wait(timeout)

    def wait_quietly(self) -> None:
        """Like ``wait`` but logs a failure instead of raising (a retry will resume from what committed)."""
        try:
            self.wait()
        except Exception as exc:
            log.warning(
                "background commit failed: %s: %s; resuming from the last committed checkpoint",
                type(exc).__name__,
                exc,
            )


def finish(r: CommitRequest, *, drop_superseded: bool = False) -> CheckpointInfo:
    """The one end of every commit (now, in the background, or a snapshot's upload): the files, the manifest and
    ``latest`` (fenced), then what the new checkpoint makes superfluous: with ``drop_superseded``, this writer's
    snapshots inside a unit older than it; then, unless it is such a snapshot itself (``INTERMEDIATE``), the
    retention, which counts unit checkpoints only (the same store, which knows what is in flight).

    The whole commit runs under the store's retry policy: a transient fault mid-stream (a streamed file is one
    request, not retried by itself) tries the commit again until store_retry_max_seconds is spent; its first
    step removes what the failed try wrote. A full disk or a refused folder is one line naming the checkpoint."""
    info = r.store.storage.retried(f"upload of checkpoint {r.name}", lambda: _commit(r), key=f"{CHECKPOINTS}/{r.name}")
    if drop_superseded:
        _delete_superseded(r.store, info)
    if not r.metadata.get(INTERMEDIATE):
        r.retention.apply(r.store)
    return info


def _delete_superseded(store: CheckpointStore, newest: CheckpointInfo) -> None:
    """Deletes this writer's snapshots inside a unit older than ``newest`` (just committed): each was the newest state
    only until the next one, and a run with a snapshot every step would otherwise keep thousands. Another writer's
    (a roll-back's record, say) are left alone."""
    try:
        infos = store.list()
    except Exception:  # best-effort; the next commit tries again
        return
    names = [i.name for i in infos]
    if newest.name not in names:
        return
    generation = newest.manifest.writer.generation
    for info in infos[: names.index(newest.name)]:
        if info.manifest.metadata.get(INTERMEDIATE) and info.manifest.writer.generation == generation:
            try:
                store.delete(info.name)
            except Exception as exc:
                log.info("could not delete superseded snapshot %s: %s", info.name, exc)


def _commit(r: CommitRequest) -> CheckpointInfo:
    if r.objects is not None:
        from checkpointing.commit.streaming import save_streaming

        return save_streaming(r.store, r.name, r.objects, progress=r.progress, metadata=r.metadata, writer=r.writer)
    return r.store.commit(r.name, r.blobs, progress=r.progress, metadata=r.metadata, writer=r.writer)
