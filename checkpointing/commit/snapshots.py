"""Checkpoints at the cost of a memory copy: the training thread copies the state into reused host buffers and goes
on; checksums, the host-memory tier's record and the upload to the store happen on two background threads.

``SnapshotPipeline.take`` is the whole stall: the state's tensors are copied into a slot (CPU tensors with one
``copy_`` each; CUDA tensors on a side stream into pinned memory, the copy overlapping the next forward and
backward: ``before_step`` makes the next ``optimizer.step()`` wait for it on the GPU, not on the host). Then:

1. the publish thread waits for the copy, checksums the slot and writes its record (checkpointing/host_tier/tier.py):
   from then on a relaunch on this machine can resume from it;
2. the upload thread commits the newest published slot to the store through the one commit path (files ->
   manifest -> ``latest``: ``committer.finish``), streaming ``torch.save`` straight from the slot. While one
   upload runs, newer snapshots keep reaching the host-memory tier; the store gets the newest one once the upload
   is done and the thread has rested (``UPLOAD_DUTY``). A snapshot taken ``must_upload`` (a unit's last, a
   preemption's) is always uploaded, in order and at once, and its ``PendingCommit`` reports it.

Slots (at most three, each the size of the state) are made on a thread of their own (checkpointing/commit/slots.py),
one at a time: the first as soon as the state's size is known (``prepare``, at a unit's start, while the first steps
run), the next once a snapshot is published and no free one is left. The newest published one is never written (a
kill during a copy leaves it whole), nor the one being uploaded, nor the ones queued to upload; a copy goes to any
other. Three cover every case; two suffice when uploads keep pace. A snapshot whose free slot is still being made
waits for it, as one waits when newest, uploading and queued snapshots hold all three (uploads lagging): never
skipped, so the snapshots a run publishes do not depend on timing. The wait is counted apart from the copy (``Stats``,
a unit's ``snapshot_wait_seconds_max``), and it is the allocation's remainder, not the whole: what training ran since
the slot was asked for is time the training thread did not wait.

Without the tier (turned off, or ``/dev/shm`` short or not private) the slots are private memory: the same copy,
the same background commit, nothing that survives the process.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointing.commit.agent import Agent
from checkpointing.commit.committer import (
    INTERMEDIATE,
    CommitRequest,
    CommitTerms,
    PendingCommit,
    finish,
    land_and_close,
    snapshot_request,
)
from checkpointing.commit.slots import SlotPool, unpin_all
from checkpointing.host_tier.tier import (
    MAX_SLOTS,
    TENSOR_MARK,
    HostTier,
    Record,
    Slot,
    TensorEntry,
    checksum,
    layout,
    rebuild,
)
from checkpointing.io.redact import redact_uri
from checkpointing.store import CheckpointInfo

log = logging.getLogger(__name__)

# The share of time the upload thread may spend on snapshots inside a unit: uploading back to back (serializing, sha256,
# writing, on a thread that shares the GIL with training) cost 7 % of a 195 ms CPU step at one snapshot a step; resting
# 9x as long as the last upload took between two of them brings it near 1 %. The host-memory tier holds every snapshot
# meanwhile; a unit's last snapshot (and a preemption's) is uploaded at once.
UPLOAD_DUTY = 0.1


# -- the state, split into tensors and the rest ------------------------------------------------------------
@dataclass
class Flat:
    """A state tree with its tensors taken out: ``tree`` holds ``{TENSOR_MARK: i}`` where tensor ``i`` was (a tensor
    met twice, tied weights say, is one entry), and fresh containers, so training may change the original ones."""

    tree: Any
    tensors: list[torch.Tensor]


_LEAVES = frozenset({int, float, bool, str, type(None)})


def flatten(objects: Any) -> Flat:
    tensors: list[torch.Tensor] = []
    seen: dict[tuple, int] = {}

    def walk(node: Any) -> Any:
        if type(node) in _LEAVES:  # most nodes: an optimizer's parameter ids, hyper-parameters
            return node
        if isinstance(node, torch.Tensor):
            if node.layout != torch.strided or node.is_meta or type(node) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"a {type(node).__name__} ({node.layout}) cannot be snapshotted into host buffers")
            key = (node.data_ptr(), node.is_cuda, node.shape, node.stride(), node.dtype)  # tied weights: one entry
            if key not in seen:
                seen[key] = len(tensors)
                tensors.append(node)
            return {TENSOR_MARK: seen[key]}
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return node

    return Flat(walk(objects), tensors)


# -- the pipeline ------------------------------------------------------------------------------------------
@dataclass
class _Job:
    """A snapshot in a slot: published (``record``), then perhaps uploaded; or (``request``, no slot) a checkpoint
    already serialized on the training thread, a state the slots cannot hold (``submit``)."""

    slot: Slot | None
    terms: CommitTerms
    name: str
    entries: list[TensorEntry]
    tree: Any
    must_upload: bool
    network_weights: bool
    pending: PendingCommit
    claim: dict[str, Any]  # the store's claim of the writer's generation: a relaunch checks it is still there
    seq: int = 0
    event: Any = None  # the CUDA copy's event
    published: bool = False
    upload: bool = True  # False: host memory only (an FSDP rank's shards; the store gets the unit's sharded commit)
    request: CommitRequest | None = None  # submit's serialized checkpoint (no slot)


@dataclass
class Taken:
    """What ``take`` gave back: the snapshot's commit (reported once uploaded, for ``must_upload``), the stall
    (``seconds``), of which ``copy_seconds`` copying and ``waited`` waiting for a slot (being made, or held by
    uploads that lag)."""

    pending: PendingCommit
    seconds: float
    copy_seconds: float = 0.0
    waited: float = 0.0


@dataclass
class Stats:
    """What snapshots cost the training thread, apart: copies and waits for a slot."""

    taken: int = 0
    waits: int = 0  # snapshots that waited for a slot
    copy_seconds_max: float = 0.0
    wait_seconds_max: float = 0.0

    def add(self, taken: Taken) -> None:
        self.taken += 1
        self.waits += taken.waited > 0
        self.copy_seconds_max = max(self.copy_seconds_max, taken.copy_seconds)
        self.wait_seconds_max = max(self.wait_seconds_max, taken.waited)


@dataclass
class Usage:
    """Host memory the pipeline holds, for people and benchmarks."""

    slots: int = 0
    bytes: int = 0
    shared: bool = False
    pinned: bool = False
    tier_path: str = ""
    notes: list[str] = field(default_factory=list)


class SnapshotPipeline:
    """Snapshots of one run from one process (one rank). ``tier``: the host-memory tier, or None for private slots."""

    def __init__(self, store_uri: str, rank: int, tier: HostTier | None, agent: Agent | None = None):
        self.store_uri, self.rank = store_uri, rank
        self.agent = agent  # commits the newest published snapshot if this process dies without close() (agent.py)
        self._lock = threading.Condition()
        self.slots = SlotPool(tier, self._lock, self._warn)  # made on the snapshot-slots thread
        self._newest: _Job | None = None  # published, newest
        self._uploading: _Job | None = None
        self._queued: list[_Job] = []  # must upload, waiting for the upload thread (oldest first)
        self._offered: _Job | None = None  # newest published, may upload
        self._uploaded_seq = -1
        self._closed = False
        self._next_intermediate_at = 0.0  # monotonic time before which no snapshot inside a unit is uploaded
        self._timer: threading.Timer | None = None
        self._failure: BaseException | None = None
        self._publishing: Future[None] | None = None
        # taken and handed to the publish thread, not yet published nor failed (at most one: ``take`` waits for the one
        # before); ``_publish`` clears it either way
        self._unpublished: _Job | None = None
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="snapshot-publish")
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="snapshot-upload")
        self._stream: Any = None
        self._layout_key: tuple[Any, ...] = ()
        self._layout_value: tuple[list[TensorEntry], int] = ([], 0)
        self._views: dict[int, tuple[list[TensorEntry], Slot, list[torch.Tensor]]] = {}
        self._copy_event: Any = None
        self._warned: set[str] = set()
        self.usage = Usage(shared=tier is not None, tier_path=tier.path if tier else "")
        self.stats = Stats()  # the run's; a unit's figures are the Checkpointer's
        self._seq = 1 + max((r.seq for _, r in tier.records(rank)), default=0) if tier else 0
        # Buffers page-locked for CUDA are unregistered before their memory is unmapped, even when the pipeline is
        # dropped without close(): CUDA keeps the registration, and a new mapping at that address fails to register.
        weakref.finalize(self, unpin_all, self.slots.slots)
        self._held_by_tier = self._newest_on_disk() if tier else None
        self.copies_refused: str | None = None  # why this run's state cannot be copied into slots (``flatten``)
        _OPEN.add(self)

    # -- the training thread ------------------------------------------------------------------------
    def take(
        self,
        objects: dict[str, Any],
        terms: CommitTerms,
        name: str,
        *,
        must_upload: bool,
        upload: bool = True,
        network_weights: bool = False,
        claim: dict[str, Any] | None = None,
    ) -> Taken:
        """Copies ``objects`` (file name -> object for ``torch.save``) into a slot and hands it to the background,
        waiting for a free slot first if none is ready (``Taken.waited``). TypeError when the state holds tensors that
        cannot be copied this way (the caller commits it the old way)."""
        t0 = time.perf_counter()
        flat = flatten(objects)
        self._wait_published()
        entries, size = self._layout(flat.tensors)
        slot, waited = self._claim_slot(size, any(t.is_cuda for t in flat.tensors), name)
        pending = PendingCommit(name, terms.store.storage.uri(f"checkpoints/{name}"), 0, dict(terms.progress))
        pending.metadata = dict(terms.metadata)
        if self.tier is not None and slot.shared:
            self.tier.invalidate(slot.index)
        c0 = time.perf_counter()
        event = self._copy(flat.tensors, self._targets(slot, entries), slot)
        copied = time.perf_counter() - c0
        pending.size_bytes = sum(e.nbytes for e in entries)
        job = _Job(slot, terms, name, entries, flat.tree, must_upload, network_weights, pending, claim or {})
        job.event, job.upload = event, upload
        with self._lock:
            job.seq, self._seq = self._seq, self._seq + 1
            self._publishing = self._publisher.submit(self._publish, job)
            self._unpublished = job
        taken = Taken(pending, time.perf_counter() - t0, copied, waited)
        self.stats.add(taken)
        return taken

    def prepare(self, objects: dict[str, Any]) -> None:
        """Has the slot thread make the first slot for a state like ``objects`` now, while training runs, so that the
        first snapshot finds it made (or waits only for the rest of its making). Called at each unit's start; once a
        slot is made (or being made) it does nothing. A state that cannot be copied into slots is left to ``take``."""
        try:
            flat = flatten(objects)
        except TypeError:
            return
        _, size = self._layout(flat.tensors)
        with self._lock:
            if not self._closed:
                self._free_slot(size, any(t.is_cuda for t in flat.tensors))

    def _claim_slot(self, size: int, pin: bool, name: str) -> tuple[Slot, float]:
        """A free slot made for ``size`` bytes and the seconds waited for it: for the slot thread to finish making one
        (asked for here if ``prepare`` did not, or for a state that grew), or, when uploads lag so far that newest,
        uploading and queued snapshots hold all three slots, for an upload to end. Never skipped: a skip would make
        the snapshots a run publishes, and what a kill loses, depend on how fast memory was reserved."""
        waited = 0.0
        with self._lock:
            self.slots.take_failure()  # an older making's error: this snapshot asks again
            slot = self._free_slot(size, pin)
            while slot is None:
                w0 = time.perf_counter()
                self._lock.wait(1.0)
                waited += time.perf_counter() - w0
                if (failure := self.slots.take_failure()) is not None:
                    raise failure  # its slot cannot be made (out of memory, say): the unit fails, as before
                slot = self._free_slot(size, pin)
        if waited > 0.05:
            log.info("snapshot %s waited %.2fs for a free snapshot buffer", name, waited)
        return slot, waited

    def submit(self, request: CommitRequest) -> PendingCommit:
        """Commits a checkpoint serialized on the training thread (``request.blobs``: a state that ``take`` refused)
        on the upload thread, in order after the snapshots that must reach the store before it; the one background
        commit path of a process."""
        if request.objects is not None:
            raise ValueError("a background commit takes serialized blobs, not live objects")
        pending = PendingCommit(request.name, request.uri, request.size_bytes, request.progress, request.metadata)
        job = _Job(None, CommitTerms(request.store, request.progress, request.writer, request.metadata,
                                     request.retention), request.name, [], None, True, False, pending, {})  # fmt: skip
        job.request, job.published = request, True
        with self._lock:
            if self._closed:
                raise RuntimeError("the snapshot pipeline is closed")
            job.seq, self._seq = self._seq, self._seq + 1
            self._queued.append(job)
            self._pump()
        return pending

    def _layout(self, tensors: list[torch.Tensor]) -> tuple[list[TensorEntry], int]:
        """Where each tensor goes in a slot, and the bytes it takes; worked out once while the state keeps its shapes."""
        key = tuple((t.dtype, t.shape) for t in tensors)
        if self._layout_key != key:
            nbytes = [t.numel() * t.element_size() for t in tensors]
            offsets, size = layout(nbytes)
            entries = [
                TensorEntry(o, str(t.dtype).removeprefix("torch."), tuple(t.shape), n)
                for o, t, n in zip(offsets, tensors, nbytes, strict=True)
            ]
            self._layout_key, self._layout_value = key, (entries, size)
        return self._layout_value

    def _targets(self, slot: Slot, entries: list[TensorEntry]) -> list[torch.Tensor]:
        """Tensors over the slot's bytes for ``entries``, made once per slot and layout."""
        cached = self._views.get(slot.index)
        if cached is None or cached[0] is not entries or cached[1] is not slot:
            cached = (entries, slot, [slot.tensor(e) for e in entries])
            self._views[slot.index] = cached
        return cached[2]

    def before_step(self) -> None:
        """Called before ``optimizer.step()``. On the GPU, the step waits (on the device, not the host) for the
        snapshot copy of the parameters it will change. On the CPU, the host waits for the snapshot before it to be
        published (checksummed and recorded), which the next snapshot waits for anyway: a step never completes while
        the snapshot before it is unpublished, so a kill loses at most the step in progress, however slowly a loaded
        machine publishes (a kill after step N's line, with N-1 still publishing, resumed at N-2)."""
        event, self._copy_event = self._copy_event, None
        if event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        elif self._stream is None:
            self._wait_published()

    @torch.no_grad()
    def _copy(self, sources: list[torch.Tensor], targets: list[torch.Tensor], slot: Slot) -> Any:
        on_gpu = [(s, t) for s, t in zip(sources, targets, strict=True) if s.is_cuda]
        on_cpu = [(s, t) for s, t in zip(sources, targets, strict=True) if not s.is_cuda]
        if on_cpu:  # one call for all of them: a copy_ each costs ~20 us of overhead, 6 ms for 300 small tensors
            torch._foreach_copy_([t for _, t in on_cpu], [s for s, _ in on_cpu])
        if not on_gpu:
            return None
        device = on_gpu[0][0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the state as the last step left it
        with torch.cuda.stream(self._stream):
            for s, t in on_gpu:
                t.copy_(s, non_blocking=True)
                s.record_stream(self._stream)  # a temporary's memory is not reused before the copy read it
        event = torch.cuda.Event()
        event.record(self._stream)
        self._copy_event = event
        return event

    def _free_slot(self, size: int, pin: bool) -> Slot | None:
        """(lock held) A slot no snapshot holds, made for ``size`` bytes; the free ones not made yet are asked for."""
        free = self._free_indices()
        ready = [slot for i in free if (slot := self.slots.ready(i, size, pin)) is not None]
        if not ready:
            self.slots.want(free, size, pin)
        self.usage.slots, self.usage.bytes, self.usage.pinned = (
            len(self.slots.slots),
            self.slots.nbytes,
            self.slots.pinned,
        )
        self.usage.shared, self.usage.tier_path = self.tier is not None, self.tier.path if self.tier else ""
        return ready[0] if ready else None

    def _free_indices(self) -> list[int]:
        """(lock held) The slots no snapshot holds: not the newest, the one uploading, the queued ones, nor the one a
        dead process of this run left newest in the tier."""
        held = {j.slot.index for j in (self._newest, self._uploading, *self._queued) if j is not None and j.slot}
        if self._held_by_tier is not None:
            held.add(self._held_by_tier)
        return [i for i in range(MAX_SLOTS) if i not in held]

    @property
    def tier(self) -> HostTier | None:
        """The host-memory tier, or None (off, or turned off when it could not hold a slot: the slot thread's)."""
        return self.slots.tier

    @tier.setter
    def tier(self, tier: HostTier | None) -> None:
        self.slots.tier = tier

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.usage.notes.append(message)
            log.warning(message)

    def _wait_published(self) -> None:
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            try:
                publishing.result()
            except Exception as exc:  # the slot stays unpublished: the tier keeps the one before it
                log.warning("snapshot could not be published to the host-memory tier: %s: %s", type(exc).__name__, exc)

    # -- the publish thread -------------------------------------------------------------------------
    def _publish(self, job: _Job) -> None:
        try:
            self._publish_now(job)
        finally:  # published (then queued or offered for upload), or failed: no longer in flight as unpublished
            with self._lock:
                if self._unpublished is job:
                    self._unpublished = None

    def _publish_now(self, job: _Job) -> None:
        assert job.slot is not None  # taken, not submitted
        if job.event is not None:
            job.event.synchronize()
        if self.tier is not None and job.slot.shared:
            try:
                self._record(job)
            except Exception as exc:  # past the cap, say: the tier keeps the ones before; the store still gets it
                self._warn("record", f"snapshots not recorded in the host-memory tier: {type(exc).__name__}: {exc}")
        with self._lock:
            job.published = True
            self._newest = job
            self._held_by_tier = None  # from now on this process's own snapshots say which slot is newest
            if not job.upload:
                job.pending.settle()
            elif job.must_upload:  # every unit's last snapshot reaches the store, in order
                self._queued.append(job)
            else:
                self._offered = job
            self._pump()
            self._free_slot(self._layout_value[1], self._stream is not None)  # the next snapshot's, made meanwhile
            self._lock.notify_all()

    def _record(self, job: _Job) -> None:
        """Checksums the slot and writes its tree and record: from then on a relaunch here may resume from it."""
        assert self.tier is not None and job.slot is not None
        buffer = io.BytesIO()
        torch.save(job.tree, buffer)
        tree = buffer.getvalue()
        used = max((e.offset + e.nbytes for e in job.entries), default=0)
        record = Record(
            name=job.name,
            progress=dict(job.terms.progress),
            metadata={**job.terms.metadata, "claim": job.claim},
            generation=job.terms.writer.generation,
            seq=job.seq,
            tensors=job.entries,
            data_bytes=used,
            data_xxh=checksum(memoryview(job.slot.buffer)[:used]),
            tree_xxh=checksum(tree),
            store_uri=self.store_uri,
        )
        self.tier.publish(job.slot, record, tree)

    # -- the upload thread --------------------------------------------------------------------------
    def _pump(self) -> None:
        """Starts the next upload if none runs (lock held): a queued must-upload first, else the newest offered."""
        if self._uploading is not None or self._closed:
            return
        queued = self._queued[0] if self._queued else None
        job = queued or self._offered
        if job is self._offered and job is not None and job.seq <= self._uploaded_seq:
            job = None
        if job is None:
            return
        wait = self._next_intermediate_at - time.monotonic()
        if job is not queued and wait > 0:  # a snapshot inside a unit: the upload thread rests first
            if self._timer is None:
                self._timer = threading.Timer(wait, self._pump_later)
                self._timer.daemon = True
                self._timer.start()
            return
        if job is queued:
            self._queued.pop(0)
        if self._offered is not None and self._offered.seq <= job.seq:
            self._offered = None
        self._uploading = job
        self._uploader.submit(self._upload, job)

    def _pump_later(self) -> None:
        with self._lock:
            self._timer = None
            self._pump()

    def _upload(self, job: _Job) -> None:
        error: BaseException | None = None
        info = None
        started = time.monotonic()
        try:
            if job.request is not None:
                info = _commit_serialized(job.request)
                return
            assert job.slot is not None
            entries = [job.slot.tensor(e) for e in job.entries]
            t = job.terms
            level = logging.DEBUG if t.metadata.get(INTERMEDIATE) else logging.INFO  # not a line a step
            objects = rebuild(job.tree, entries)
            request = snapshot_request(t, job.name, objects, network_weights=job.network_weights)
            job.name = request.name  # a snapshot inside a unit is named here, not on the training thread
            log.log(level, "writing checkpoint %s to %s", job.name, redact_uri(t.store.uri))
            t0 = time.perf_counter()
            # A transient fault mid-stream fails the whole file: finish tries the commit again (under the
            # store's retry policy) from the slot, which holds still while it uploads.
            info = finish(request, drop_superseded=True)  # then superseded snapshots deleted, then the retention
            log.log(
                level,
                "snapshot %s committed to the store from host memory: %.1f MB in %.2fs",
                job.name,
                info.size_bytes / 1e6,
                time.perf_counter() - t0,
            )
        except BaseException as exc:
            error = exc
            if job.must_upload:
                log.warning("upload of snapshot %s failed: %s: %s", job.name, type(exc).__name__, exc)
            else:  # a newer snapshot will be uploaded; the host-memory tier still holds this one
                log.warning("upload of intermediate snapshot %s failed (a newer one follows): %s", job.name, exc)
        finally:
            with self._lock:
                self._uploading = None
                ended = time.monotonic()
                self._next_intermediate_at = ended + (ended - started) * (1 / UPLOAD_DUTY - 1)
                if error is None:
                    self._uploaded_seq = max(self._uploaded_seq, job.seq)
                elif job.must_upload:
                    self._failure = error
                job.pending.settle(info, error)
                self._pump()
                self._lock.notify_all()

    # -- waiting, and the end ---------------------------------------------------------------------------
    def in_flight(self) -> str | None:
        """The newest snapshot that must reach the store and has not yet (the name a next unit starts from)."""
        with self._lock:
            jobs = [j for j in (*self._queued, self._uploading) if j is not None and j.must_upload]
            taken = self._unpublished  # still being published: queued for upload right after
            if taken is not None and taken.must_upload and taken.upload:
                jobs.append(taken)
        return max(jobs, key=lambda j: j.seq).name if jobs else None

    def keep_newest(self) -> None:
        """Training failed (the process lives on): the newest snapshot, still in publication or resting before its
        upload, becomes a must-upload, so that a retry (which waits for what is in flight) resumes from it, even where
        it cannot read this machine's tier (the tier is off, or the retry runs elsewhere)."""
        self._wait_published()
        with self._lock:
            if self._uploading is not None:
                self._uploading.must_upload = True  # wait() waits for it: it may be the newest
            job = self._offered
            if job is None or job.seq <= self._uploaded_seq or self._closed:
                return
            job.must_upload = True
            self._offered = None
            self._queued.append(job)
            self._next_intermediate_at = 0.0
            self._pump()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every must-upload snapshot taken so far is committed; re-raises the failure of one that was
        not. TimeoutError after ``timeout`` seconds (the uploads go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        publishing = self._publishing
        if publishing is not None:
            publishing.result(timeout=timeout)
        with self._lock:
            while self._queued or (self._uploading is not None and self._uploading.must_upload):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("the snapshot upload is still in flight")
                self._lock.wait(left)
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def remove_tier(self) -> None:
        """The run completed: its snapshots leave this machine's memory."""
        if self.tier is not None:
            self.tier.remove()
            self.tier = None

    def close(self) -> None:
        """Finishes the publish and the upload in flight; starts no other. A second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        _OPEN.discard(self)
        self._publisher.shutdown(wait=True)
        self._uploader.shutdown(wait=True)
        self.slots.close()  # its thread ends, every slot is unpinned
        if self.tier is not None:
            self.tier.close()
        if self.agent is not None:  # the run closed as it should: nothing for the agent to do
            self.agent.close()

    def _newest_on_disk(self) -> int | None:
        """A relaunched process: the slot holding the newest record a dead process left (never overwritten first)."""
        assert self.tier is not None
        records = list(self.tier.records(self.rank))
        return max(records, key=lambda r: r[1].seq)[0] if records else None


_OPEN: weakref.WeakSet[SnapshotPipeline] = weakref.WeakSet()  # the pipelines of this process not yet closed


def close_all() -> None:
    """Lets every pipeline of this process that is still open land its uploads (or fail, logged), then closes it: its
    threads end, its agent leaves. A run closes its own (``Run.close``); this is what training/process_state.py's
    reset forgets, for pipelines of committers no run owns (a unit attempted outside a run)."""
    for pipeline in list(_OPEN):
        land_and_close(pipeline)


def _commit_serialized(request: CommitRequest) -> CheckpointInfo:
    t0 = time.perf_counter()
    log.info("writing checkpoint %s to %s", request.name, redact_uri(request.store.uri))
    info = finish(request)
    log.info(
        "checkpoint %s committed in the background: %.1f MB in %.2fs",
        request.name,
        info.size_bytes / 1e6,
        time.perf_counter() - t0,
    )
    return info
