"""sha256 of checkpoint bytes, computed on one shared helper pool while the caller reads or writes.

hashlib releases the GIL for large buffers, so a helper thread hashes one buffer while the caller's thread
moves the next one to or from the store: verifying a checkpoint then costs little more than reading it.
Reads (``Storage.get_hashed``), streamed writes (``streaming.HashingWriter``) and whole-file commits
(``CheckpointStore.commit``) all hash here, on one small pool, instead of each module keeping its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-hash")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def in_background(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Runs a hashing job (``fn(*args)``) on the shared pool; the caller collects it with ``.result()``."""
    return _POOL.submit(fn, *args)


class BackgroundSha256:
    """A sha256 fed buffer by buffer, each hashed on the pool while the caller goes on (one in flight).

    ``submit`` returns at once: the caller must not change that buffer until the next ``submit``, ``wait``
    or ``hexdigest``, which wait for it. ``update`` hashes a (small) buffer on the caller's thread."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._pending: Future[None] | None = None

    def submit(self, data: Any) -> None:
        self.wait()
        self._pending = in_background(self._digest.update, data)

    def update(self, data: Any) -> None:
        self.wait()
        self._digest.update(data)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._digest.hexdigest()
