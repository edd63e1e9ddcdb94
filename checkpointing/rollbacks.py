"""Roll-back records, ``rollbacks/<generation>.json``: what a ``resume_from`` set aside, vouched for like manifests.

A record says: writer generation G rolled the run back to checkpoint T, whose manifest order (generation,
samples seen, time) was O. From then on every checkpoint written by a generation older than G that got
further than O is set aside: kept, listed, never a candidate. The record is the only thing that says so, and
anyone who may write the bucket may write it, so it is read like any small file of the store (untrusted.py:
bounded, nesting measured, every field typed), and it carries a sha256 of its own content, as manifests do
since format 2. Its file name must be its generation. A record that fails any of this is damaged: a warning
names the file (never its content) and the record is ignored.

What "ignored" means. A damaged record sets nothing aside: one changed digit must never hide good checkpoints
(before checksums, a changed generation set aside every commit made since, and the run stopped). Ignoring
must not let the run resume from the lineage the roll-back set aside either, and two other witnesses keep
that from happening without the record:

1. ``latest``: ``roll_back`` moves it to the target with the roll-back's generation G, higher than the
   target's own writer generation; a commit always writes its own generation, so only a roll-back leaves such
   a pointer. While ``latest`` is that pointer, the store reads it as the record (``witness``).
2. generation order: once generation G has committed a checkpoint, every checkpoint of G outranks every
   checkpoint of older generations, set aside or not.

Retention goes further: while a damaged record of generation G exists, it deletes no checkpoint of an older
generation (deleting is for good, and it cannot tell which of them the record set aside). What is left is
a double fault: a damaged record, ``latest`` moved on, and every checkpoint written since the roll-back
failing verification; the fallback may then reach the set-aside lineage. Checksums catch damage, not a
person who can write the bucket: such a person can compute the checksum, as for a manifest (and could delete
checkpoints anyway); what they cannot do is run code or stop every relaunch.

Records from before checksums (no ``format_version``) are read only when everything they say is vouched for
elsewhere: the file name gives their generation, and their target's manifest (checksummed) still exists and
has the order they give. Why keep them at all: a run rolled back by an earlier version and launched again with
the same ``resume_from`` must find its roll-back applied, or it would roll back again and set aside all that
was trained since. A record from before checksums whose target is gone is damaged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpointing.errors import DamagedFileError
from checkpointing.io.hashing import sha256_hex
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import (
    MAX_INT,
    MAX_LISTED,
    MAX_ROLLBACK_BYTES,
    as_dict,
    as_float,
    as_int,
    printable,
    read_json,
)
from checkpointing.manifest import Manifest, is_valid_name

ROLLBACKS = "rollbacks"
RECORD_VERSION = 2
_RECORD_NAME = re.compile(r"^([0-9]{1,19})\.json$")

Order = tuple[int, int, float]
Warn = Callable[[str, str], None]  # (file, problem): reported once per store


@dataclass(frozen=True)
class RollBack:
    """Writer ``generation`` rolled the run back to checkpoint ``to``, whose manifest order was ``order``."""

    generation: int
    to: str
    order: Order

    def sets_aside(self, manifest: Manifest) -> bool:
        """Written by an older generation than the roll-back, and got further than its target."""
        return manifest.writer.generation < self.generation and manifest.order > self.order

    def as_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "to": self.to, "order": list(self.order)}


@dataclass(frozen=True)
class RollBacks:
    """The run's roll-backs (trusted records and the witness in ``latest``), and the generations of damaged ones."""

    records: tuple[RollBack, ...] = ()
    damaged: tuple[int, ...] = ()

    def sets_aside(self, manifest: Manifest) -> bool:
        return any(rb.sets_aside(manifest) for rb in self.records)

    def may_have_set_aside(self, manifest: Manifest) -> bool:
        """Whether a damaged record could have set this checkpoint aside: retention keeps it."""
        return any(manifest.writer.generation < generation for generation in self.damaged)


def witness(latest_generation: int, name: str, manifest: Manifest) -> RollBack | None:
    """The roll-back ``latest`` witnesses, if any: only a roll-back moves ``latest`` with a generation above that
    of the checkpoint it names (a commit writes its own)."""
    if latest_generation > manifest.writer.generation:
        return RollBack(latest_generation, name, manifest.order)
    return None


def record(generation: int, to: str, order: Order, set_aside: list[str]) -> tuple[str, bytes]:
    """(key, bytes) of the record of a roll-back; for people it lists (at most MAX_LISTED of) what it set aside."""
    body = {
        "format_version": RECORD_VERSION,
        "generation": generation,
        "to": to,
        "order": list(order),
        "set_aside": set_aside[:MAX_LISTED],
        "num_set_aside": len(set_aside),
    }
    data = json.dumps({**body, "checksum": _checksum(body)}, indent=1, sort_keys=True).encode()
    return f"{ROLLBACKS}/{generation:012d}.json", data


def read_all(
    storage: Storage, manifest_of: Callable[[str], Manifest | None], witness: RollBack | None, warn: Warn
) -> RollBacks:
    """Every record under ``rollbacks/`` that can be trusted, plus ``witness`` (from ``latest``) when no record
    of its generation could be; damaged records are reported through ``warn`` and set nothing aside."""
    names = storage.sizes(ROLLBACKS) if storage.exists(ROLLBACKS) else {}
    found: dict[int, RollBack] = {}
    damaged = []
    for fname in sorted(names):
        match = _RECORD_NAME.match(fname)
        if fname.startswith("."):  # a temporary file of a local write cut short (localfs.py)
            continue
        if match is None or fname != f"{int(match.group(1)):012d}.json":
            warn(storage.uri(f"{ROLLBACKS}/{printable(fname)[:200]}"), "not a roll-back record's name; ignored")
            continue
        generation = int(match.group(1))
        try:
            found[generation] = _read(storage, fname, generation, manifest_of)
        except FileNotFoundError:  # gone since the listing, or a link (never followed)
            continue
        except DamagedFileError as exc:
            warn(
                storage.uri(f"{ROLLBACKS}/{fname}"),
                f"damaged ({exc}); ignored: it sets nothing aside, and retention keeps every checkpoint of "
                f"older writers while it is there",
            )
            damaged.append(generation)
    if witness is not None and witness.generation not in found:
        found[witness.generation] = witness
    return RollBacks(tuple(found[g] for g in sorted(found)), tuple(damaged))


def _read(storage: Storage, fname: str, generation: int, manifest_of: Callable[[str], Manifest | None]) -> RollBack:
    raw = as_dict(read_json(storage, f"{ROLLBACKS}/{fname}", MAX_ROLLBACK_BYTES), "the record")
    if "format_version" not in raw:
        return _vouched_by_target(_typed(raw), generation, manifest_of)
    if raw.get("format_version") != RECORD_VERSION:
        raise DamagedFileError(f"its format_version is not {RECORD_VERSION}")
    if raw.pop("checksum", None) != _checksum(raw):
        raise DamagedFileError("its content does not match its own checksum: it was altered or damaged")
    found = _typed(raw)
    if found.generation != generation:
        raise DamagedFileError("its generation is not the one its file name gives")
    return found


def _vouched_by_target(found: RollBack, generation: int, manifest_of: Callable[[str], Manifest | None]) -> RollBack:
    """A record from before checksums, trusted only as far as its file name and its target's manifest vouch."""
    target = manifest_of(found.to)
    if found.generation != generation or target is None or target.order != found.order:
        raise DamagedFileError(
            "a record from before checksums that its file name and its target's manifest do not vouch for"
        )
    return found


def _typed(raw: dict[str, Any]) -> RollBack:
    to, order = raw.get("to"), raw.get("order")
    if not isinstance(to, str) or not is_valid_name(to):
        raise DamagedFileError("'to' is not a checkpoint name")
    if not isinstance(order, list) or len(order) != 3:
        raise DamagedFileError("'order' is not [generation, samples seen, time]")
    return RollBack(
        generation=as_int(raw.get("generation"), "generation", MAX_INT),
        to=to,
        order=(as_int(order[0], "order[0]"), as_int(order[1], "order[1]"), as_float(order[2], "order[2]")),
    )


def _checksum(body: dict[str, Any]) -> str:
    return sha256_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
