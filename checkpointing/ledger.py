"""A sweep's event ledger: numbered JSON events in a store folder, appended exclusively and read as untrusted.

A sweep killed at any moment must continue where it stood, so what it decided lives in the store, one event per
file (``<prefix>/events/00000000.json``, ``00000001.json``, ...), each written once with ``Storage.create`` (local:
a temporary file linked into place; S3: a conditional put), so a file is there whole or not at all. Two sweep
processes writing one sweep would each act on a state the other changes: the second to claim a number is fenced
(``LedgerFencedError``) instead of writing beside the first.

Every event is checksummed (sha256 over its canonical JSON) and read back bounded, typed and verified. A damaged
event stops the reader with one ``LedgerError`` naming the file: skipping it would fold a wrong state (a trial
retrained, or one forgotten). What the events mean is training/sweep's business; this module only keeps them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import DamagedFileError, LedgerError, LedgerFencedError
from checkpointing.io.localfs import NOT_A_FILE
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import as_dict, as_float, as_int, as_str, nesting_depth, parse_json, printable

log = logging.getLogger(__name__)

FORMAT = 1
EVENTS = "events"
MAX_EVENT_BYTES = 256 << 10  # the largest event (a segment_finished of a long trial) is a few KiB per unit
MAX_EVENTS = 100_000
MAX_DEPTH = 32  # the event object, its body, and params/metrics a few levels down
MAX_WRITER = 256
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_EVENT_FILE = re.compile(r"^[0-9]{8}\.json$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"format", "seq", "kind", "time", "writer", "body", "sha256"}
_FIX = "restore that file from a copy of the bucket, or start the sweep afresh under a new sweep_name"


@dataclass(frozen=True)
class Event:
    """One entry of the ledger, as written and verified."""

    seq: int
    kind: str
    time: float
    writer: str
    body: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """The canonical file: compact, sorted keys, with the sha256 of everything else."""
        raw: dict[str, Any] = {
            "format": FORMAT,
            "seq": self.seq,
            "kind": self.kind,
            "time": self.time,
            "writer": self.writer,
            "body": self.body,
        }
        return _canonical({**raw, "sha256": _checksum(raw)})


def event_key(prefix: str, seq: int) -> str:
    return f"{prefix}/{EVENTS}/{seq:08d}.json"


class Ledger:
    """The events under ``prefix`` of ``storage`` (a sweep folder). ``writer`` names this process in what it
    appends (e.g. ``"host:pid"``). ``read()`` returns every event and sets the number the next ``append`` claims."""

    def __init__(self, storage: Storage, prefix: str = "sweep", writer: str = ""):
        self.storage = storage
        self.prefix = prefix.strip("/")
        self.writer = as_str(writer, "writer", MAX_WRITER)
        self._next: int | None = None

    @property
    def uri(self) -> str:
        return self.storage.uri(self.prefix)

    def read(self) -> list[Event]:
        """Every event, oldest first: one listing, then one read per event. LedgerError on the first bad one."""
        count = self._count()
        events = [self._read_event(seq) for seq in range(count)]
        self._next = count
        return events

    def append(self, kind: str, body: dict[str, Any]) -> Event:
        """Writes the next event, exclusively. LedgerFencedError when another process wrote that number first."""
        if self._next is None:
            self.read()
        assert self._next is not None
        if not isinstance(kind, str) or not _KIND.match(kind):
            raise ValueError(f"event kind {kind!r}: use 1-64 lower-case letters, digits or '_', starting with a letter")
        body = json.loads(json.dumps(as_dict(body, "body")))  # as every reader will see it (keys as text)
        event = Event(self._next, kind, time.time(), self.writer, body)
        data = event.to_json()
        problem = _shape_problem(data)
        if problem:
            raise ValueError(f"event {kind} would not be readable back ({problem}); keep event bodies small and flat")
        key = event_key(self.prefix, event.seq)
        if not self.storage.create(key, data) and not self._is_ours(key, data):
            raise LedgerFencedError(
                f"{self.storage.uri(key)} was written by another process: another sweep process is writing this "
                f"sweep ({self.uri}). Stop one of them; run one sweep command per sweep_name (relaunching the "
                f"same command after this one has stopped continues the sweep)"
            )
        self._next += 1
        return event

    def _is_ours(self, key: str, data: bytes) -> bool:
        """A create retried after its first try landed finds its own bytes there (time and writer make them unique)."""
        try:
            return self.storage.get(key, max_bytes=len(data)) == data
        except FileNotFoundError:
            return False

    def _count(self) -> int:
        """How many events there are, from one listing: names must run 00000000 … n-1, each a small regular file."""
        folder = f"{self.prefix}/{EVENTS}"
        sizes = self.storage.sizes(folder)
        ours = {name: size for name, size in sizes.items() if _EVENT_FILE.match(name)}
        others = sorted(printable(name)[:100] for name in sizes if name not in ours)
        if others:
            log.warning(
                "%s/%s: %d file(s) that are not events, ignored (%s)",
                self.uri,
                EVENTS,
                len(others),
                ", ".join(others[:5]) + (", …" if len(others) > 5 else ""),
            )
        if len(ours) > MAX_EVENTS:
            raise LedgerError(f"{self.uri}/{EVENTS}: {len(ours)} events, more than {MAX_EVENTS}; {_FIX}")
        for seq, name in enumerate(sorted(ours)):
            where = self.storage.uri(f"{folder}/{name}")
            if int(name[:8]) != seq:
                raise LedgerError(
                    f"{self.storage.uri(event_key(self.prefix, seq))}: missing, while {name} exists (events must "
                    f"be numbered without gaps); {_FIX}"
                )
            if ours[name] == NOT_A_FILE:
                raise LedgerError(f"{where}: a symbolic link or special file, never followed; {_FIX}")
            if ours[name] > MAX_EVENT_BYTES:
                raise LedgerError(
                    f"{where}: {ours[name]} bytes, more than an event may hold ({MAX_EVENT_BYTES}); {_FIX}"
                )
        return len(ours)

    def _read_event(self, seq: int) -> Event:
        key = event_key(self.prefix, seq)
        try:
            return _parse(self.storage.get(key, max_bytes=MAX_EVENT_BYTES), seq)
        except FileNotFoundError as exc:  # listed a moment ago: deleted, or a link (never followed)
            raise LedgerError(f"{self.storage.uri(key)}: listed but unreadable (gone, or a link); {_FIX}") from exc
        except DamagedFileError as exc:
            raise LedgerError(f"{self.storage.uri(key)}: {exc}; {_FIX}") from exc


def _parse(data: bytes, seq: int) -> Event:
    """The event in ``data``, every field typed and its checksum verified; DamagedFileError naming the problem."""
    problem = _shape_problem(data)
    if problem:
        raise DamagedFileError(problem)
    raw = as_dict(parse_json(data, MAX_EVENT_BYTES), "the event")
    if set(raw) != _FIELDS:
        raise DamagedFileError(f"its fields are not {', '.join(sorted(_FIELDS))}")
    version = as_int(raw["format"], "format")
    if version != FORMAT:
        raise DamagedFileError(f"format {version} is not {FORMAT}, the one this code reads (a newer version wrote it?)")
    if as_int(raw["seq"], "seq") != seq:
        raise DamagedFileError(f"its seq is not {seq}, the number in its file name")
    kind = as_str(raw["kind"], "kind", 64)
    if not _KIND.match(kind):
        raise DamagedFileError("kind is not a lower-case identifier")
    stated = as_str(raw.pop("sha256"), "sha256", 64)
    if not _SHA256.match(stated) or stated != _checksum(raw):
        raise DamagedFileError("its content does not match its sha256: it was altered or damaged")
    return Event(
        seq=seq,
        kind=kind,
        time=as_float(raw["time"], "time"),
        writer=as_str(raw["writer"], "writer", MAX_WRITER),
        body=as_dict(raw["body"], "body"),
    )


def _shape_problem(data: bytes) -> str:
    if len(data) > MAX_EVENT_BYTES:
        return f"larger than {MAX_EVENT_BYTES} bytes"
    depth = nesting_depth(data)
    return f"nested {depth} levels deep (at most {MAX_DEPTH})" if depth > MAX_DEPTH else ""


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _checksum(raw: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(raw)).hexdigest()
