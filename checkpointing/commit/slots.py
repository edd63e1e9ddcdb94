"""The snapshot pipeline's slots (checkpointing/commit/snapshots.py), made off the training thread: reserving a
state-sized buffer (``posix_fallocate`` in the host-memory tier, the first touch of every page, ``cudaHostRegister``
for CUDA copies) took 0.7-1.1 s at 190 MB and 4.5-19 s at 1.19 GB on the training thread, once for each of the
first two or three snapshots of a run.

``SlotPool`` makes slots on a thread of its own (``snapshot-slots``) as soon as the pipeline knows the state's size
(``SnapshotPipeline.prepare`` at a unit's start, else the first snapshot), one at a time: the first at once, the next
as soon as a snapshot is published and no free one is left (so a slot is usually ready before the snapshot that needs
it). A snapshot whose slot is not ready waits for the rest of its making: the training thread never allocates. ``before_make`` is a hook run on that thread before each slot is made (tests hold it
to make an allocation as slow as they need, deterministically).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from checkpointing.host_tier.tier import ROOT_ENV, HostTier, Slot, TierUnavailable

log = logging.getLogger(__name__)


class SlotPool:
    """Slots by index, each made on the ``snapshot-slots`` thread. ``lock`` is the pipeline's: it is held to ask and
    to look, and notified when a slot is ready."""

    def __init__(self, tier: HostTier | None, lock: threading.Condition, warn: Callable[[str, str], None]):
        self.tier, self._lock, self._warn = tier, lock, warn
        self.slots: dict[int, Slot] = {}
        self.making: set[int] = set()
        self.pinned_tried: set[int] = set()
        self.pinned = False
        self.made_on: list[str] = []  # the threads each slot was made on (tests, benchmarks)
        self.before_make: Callable[[int, int], None] | None = None
        # The last making's error, for a snapshot that waits (``take_failure``).
        self.failure: BaseException | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="snapshot-slots")
        self._closed = False

    # -- asked with the lock held -------------------------------------------------------------------
    def ready(self, index: int, size: int, pin: bool) -> Slot | None:
        """Slot ``index`` when it is made, at least ``size`` bytes, and page-locking was tried if ``pin``."""
        slot = self.slots.get(index)
        if slot is None or index in self.making or slot.size < size:
            return None
        return slot if not pin or index in self.pinned_tried else None

    def want(self, free: list[int], size: int, pin: bool) -> None:
        """Starts making one of the ``free`` slots when none of them is ready for ``size`` and none is being made: one
        already made (too small: a state that grew) first, else a new one. One at a time, and asked again only after
        the snapshot before was published (``SnapshotPipeline._publish``): the per-user cap (checkpointing/host_tier/
        cap.py) then counts that snapshot's record and tree before the next buffer is reserved."""
        if self._closed or self.making or not free or any(self.ready(i, size, pin) is not None for i in free):
            return
        index = next((i for i in free if i in self.slots), free[0])
        self.making.add(index)
        self._thread.submit(self._make, index, size, pin)

    # -- the snapshot-slots thread ------------------------------------------------------------------
    def _make(self, index: int, size: int, pin: bool) -> None:
        try:
            if self.before_make is not None:
                self.before_make(index, size)
            with self._lock:
                old = self.slots.pop(index, None)
            if old is not None:
                unpin(old)
            slot = self._allocate(index, size + size // 16)  # room for a state that grows a little
            torch.frombuffer(slot.buffer, dtype=torch.uint8).fill_(0)  # every page touched here, not by the copy
            if pin:
                self._pin(slot)
            with self._lock:
                self.slots[index] = slot
                if pin:
                    self.pinned_tried.add(index)
                self.made_on.append(threading.current_thread().name)
        except Exception as exc:  # the next snapshot asks again; one that waits for this slot gets the error
            log.warning("a snapshot buffer could not be made: %s: %s", type(exc).__name__, exc)
            with self._lock:
                self.failure = exc
        finally:
            with self._lock:
                self.making.discard(index)
                self._lock.notify_all()

    def _allocate(self, index: int, size: int) -> Slot:
        if self.tier is not None:
            try:
                return self.tier.allocate(index, size)
            except TierUnavailable as exc:
                self._warn("tier", f"host-memory tier off for this run: {exc}; snapshots stay in private memory")
                self.tier = None
        return Slot.private(index, size)

    def _pin(self, slot: Slot) -> None:
        """Page-locks a slot for CUDA copies (cudaHostRegister), once; without it a copy from the GPU is synchronous."""
        if not slot.pinnable:
            self._warn(
                "pin",
                f"snapshot buffers on a {slot.filesystem or 'disk'} file system cannot be page-locked, so a copy from "
                f"the GPU blocks training; put {ROOT_ENV} on a tmpfs (such as /dev/shm)",
            )
            return
        ptr = torch.frombuffer(slot.buffer, dtype=torch.uint8).data_ptr()
        code = torch.cuda.cudart().cudaHostRegister(ptr, slot.size, 0)
        if int(code) != 0:
            _absorb_cuda_error()
            self._warn(
                "pin",
                f"page-locking {slot.size / 1e6:.0f} MB of snapshot buffers failed ({code}); a copy from the GPU "
                "blocks training",
            )
            return
        slot.registered_ptr = ptr
        self.pinned = True

    def take_failure(self) -> BaseException | None:
        """(lock held) The error of a making since the last call, if one failed: a snapshot waiting for a slot raises it
        instead of waiting for ever."""
        failure, self.failure = self.failure, None
        return failure

    def wait_made(self, timeout: float | None = None) -> bool:
        """Blocks until no slot is being made (tests, benchmarks); False after ``timeout`` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.making, timeout)

    # -- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the thread (a slot being made is finished, none other started) and unpins every slot."""
        with self._lock:
            self._closed = True
        self._thread.shutdown(wait=True, cancel_futures=True)
        unpin_all(self.slots)
        self.slots.clear()

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.slots.values())


def unpin(slot: Slot) -> None:
    if slot.registered_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(slot.registered_ptr)
        slot.registered_ptr = None


def unpin_all(slots: dict[int, Slot]) -> None:
    for slot in list(slots.values()):
        unpin(slot)


def _absorb_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error to be reported by the next kernel launch, which would fail training
    at some unrelated operation: launch one here and take the stale error (the launch check reads and clears it)."""
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        log.debug("cleared the error a failed page-lock left: %s", exc)
