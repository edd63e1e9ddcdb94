"""Errors that cross a process boundary typed: a rank's ``UnsafeCheckpointError`` is one in the unit's process too.

A rank records what it raised as JSON (``error_record``); the parent rebuilds it (``error_from_record``) as the class
of that name in the product's two error modules (checkpointing/errors.py, training/exceptions.py), never from a name
it would import. What must not be retried (a configuration mistake, an unsafe or corrupt checkpoint, a fenced writer:
the ``Permanent`` ones) then is not retried, and the message still names the file; ``Preempted`` keeps its checkpoint
and step. Anything else comes back as a ``RemoteError`` (retried) carrying the type's name and message.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from checkpointing import errors as checkpoint_errors
from training import exceptions
from training.exceptions import RemoteError
from training.preemption import Preempted, Stop

MAX_MESSAGE = 4000


def _classes(module: ModuleType) -> dict[str, type[BaseException]]:
    """The error classes ``module`` defines (not those it imports), by name."""
    classes = [cls for cls in vars(module).values() if isinstance(cls, type) and issubclass(cls, BaseException)]
    return {cls.__name__: cls for cls in classes if cls.__module__ == module.__name__}


# Every error class of the product, by name: what a rank's record is rebuilt as.
REBUILT: dict[str, type[BaseException]] = {**_classes(checkpoint_errors), **_classes(exceptions)}


def error_record(exc: BaseException, rank: int) -> dict[str, Any]:
    """What a rank writes down about the error that ends it."""
    record: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)[:MAX_MESSAGE], "rank": rank}
    if isinstance(exc, Preempted):
        record.update(
            kind=exc.stop.kind,
            reason=exc.stop.reason,
            checkpoint=exc.checkpoint,
            step=exc.step,
            seconds=exc.seconds,
            note=exc.note,
        )
    return record


def error_from_record(record: Any) -> BaseException:
    """The error a rank recorded, rebuilt as the product's own type where it is one."""
    if not isinstance(record, dict):
        return RemoteError(f"a rank failed and recorded {type(record).__name__}")
    name, message = str(record.get("type", "")), str(record.get("message", ""))[:MAX_MESSAGE]
    rank = f"(on rank {record.get('rank')})"
    if name == "Preempted":
        stop = Stop(
            "handover" if record.get("kind") == "handover" else "signal", str(record.get("reason", "preempted")), 0.0
        )
        seconds = record.get("seconds")
        return Preempted(
            stop,
            record.get("checkpoint"),
            int(record.get("step") or 0),
            float(seconds) if isinstance(seconds, (int, float)) else None,
            str(record.get("note") or ""),
        )
    cls = REBUILT.get(name)
    if cls is None:
        return RemoteError(f"{name}: {message} {rank}")
    exc = cls(message)
    exc.add_note(rank)
    return exc
