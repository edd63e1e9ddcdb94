"""Errors that cross a process boundary typed: a rank's ``UnsafeCheckpointError`` is one in the unit's process too.

A rank records what it raised as JSON (``error_record``); the parent rebuilds it (``error_from_record``) from a
fixed list of the product's own error classes, never from a name it would import. What must not be retried
(a configuration mistake, an unsafe or corrupt checkpoint, a fenced writer) then is not retried, and the message
still names the file; ``Preempted`` keeps its checkpoint and step. Anything else comes back as a
``RemoteError`` (retried) carrying the type's name and message.
"""

from __future__ import annotations

from typing import Any

from checkpointing import (
    AccessDeniedError,
    CheckpointError,
    CorruptCheckpointError,
    FencedError,
    NotACheckpointError,
    PermanentStorageError,
    StorageError,
    UnsafeCheckpointError,
)
from checkpointing.io.localfs import LinkedLocationError
from checkpointing.peers.weights import WeightsError
from training.config import ConfigError
from training.preemption import Preempted, Stop

MAX_MESSAGE = 4000


class RemoteError(RuntimeError):
    """An error of another process that is none of the product's own types (retried like any failure)."""


def _known() -> dict[str, type[BaseException]]:
    from training.unit.loop import InjectedFault
    from training.unit.own_loop import LoopEndedEarlyError
    from training.unit.reported_state import ReportError

    classes: list[type[BaseException]] = [
        ConfigError, ReportError, LoopEndedEarlyError, UnsafeCheckpointError, CorruptCheckpointError,
        NotACheckpointError, FencedError, AccessDeniedError, PermanentStorageError, StorageError, CheckpointError,
        WeightsError, InjectedFault, LinkedLocationError,
    ]  # fmt: skip
    return {cls.__name__: cls for cls in classes}


def error_record(exc: BaseException, rank: int) -> dict[str, Any]:
    """What a rank writes down about the error that ends it."""
    record: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)[:MAX_MESSAGE], "rank": rank}
    if isinstance(exc, Preempted):
        record.update(kind=exc.stop.kind, reason=exc.stop.reason, checkpoint=exc.checkpoint, step=exc.step,
                      seconds=exc.seconds, note=exc.note)  # fmt: skip
    return record


def error_from_record(record: Any) -> BaseException:
    """The error a rank recorded, rebuilt as the product's own type where it is one."""
    if not isinstance(record, dict):
        return RemoteError(f"a rank failed and recorded {type(record).__name__}")
    name, message = str(record.get("type", "")), str(record.get("message", ""))[:MAX_MESSAGE]
    rank = f"(on rank {record.get('rank')})"
    if name == "Preempted":
        stop = Stop(str(record.get("kind", "signal")), str(record.get("reason", "preempted")), 0.0)
        seconds = record.get("seconds")
        return Preempted(stop, record.get("checkpoint"), int(record.get("step") or 0),
                         float(seconds) if isinstance(seconds, (int, float)) else None, str(record.get("note") or ""))  # fmt: skip
    cls = _known().get(name)
    if cls is None:
        return RemoteError(f"{name}: {message} {rank}")
    exc = cls(message)
    exc.add_note(rank)
    return exc
