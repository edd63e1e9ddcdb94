"""CheckpointStore: the checkpoints of one run in an object store, committed so that nothing torn is read.

Layout under ``<save_folder>/<run_name>/``::

    checkpoints/<name>/state.pt        model/optimizer/scheduler state; weights at ["state"]["model"]
    checkpoints/<name>/rng-rank<r>.pt  per-rank RNG states
    checkpoints/<name>/manifest.json   size + sha256 of every file above, progress, writer; written last
    latest                             {"name", "generation", "manifest_sha256"}; moved only after the manifest
    claims/<generation>                one per writer (fencing.py)
    rollbacks/<generation>.json        a ``resume_from`` roll-back: later checkpoints stop being candidates (rollbacks.py)

Commit order is files, then manifest, then ``latest``. A reader takes the newest checkpoint that verifies,
newest by (writer generation, samples seen): ``latest`` is the fast path, and a checkpoint committed after
it (a process killed between its manifest and ``latest``) is found by its name. Loading reads each file
once, hashing it as it arrives, cross-checks the progress copy inside ``state.pt`` against the manifest,
and refuses anything ``torch.load(weights_only=True)`` would not load safely.

Everything read from the store is untrusted (untrusted.py): small files are read bounded and typed, folders
under ``checkpoints/`` whose names are not checkpoint names are someone else's (left alone, reported once),
and damage is a fallback to the previous good checkpoint, never an exception that fails every relaunch.
"""

from __future__ import annotations

import builtins
import logging
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from checkpointing import pointer, rollbacks, torn
from checkpointing.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DamagedFileError,
    FencedError,
    ManifestError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from checkpointing.fencing import Fence
from checkpointing.io.hashing import in_background, sha256_hex
from checkpointing.io.localfs import NOT_A_FILE, TOO_DEEP
from checkpointing.io.redact import redact_uri
from checkpointing.io.storage import RetrySettings, Storage
from checkpointing.io.untrusted import MAX_MANIFEST_BYTES, printable
from checkpointing.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    Writer,
    describe,
    is_valid_name,
    validate_file_name,
    validate_name,
)
from checkpointing.names import checkpoint_name, may_be_past
from checkpointing.pointer import POINTER
from checkpointing.rollbacks import ROLLBACKS, RollBacks
from checkpointing.serialization import safe_load, serialize

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
SHARDED_FORMAT = "dcp"  # manifest.metadata["format"] of a sharded checkpoint (checkpointing/commit/sharded.py)
# (store URI, checkpoint name) being written by this process, whichever store object writes it: a claim's clean-up
# of torn folders (torn.py) never removes one (a snapshot pipeline of an earlier run may still be uploading)
_WRITING: set[tuple[str, str]] = set()
CHECKPOINTS = "checkpoints"

__all__ = [
    "POINTER",
    "ROLLBACKS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CorruptCheckpointError",
    "FencedError",
    "LoadedCheckpoint",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "serialize",
    "validate_file_name",
    "validate_name",
]


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    name: str
    uri: str
    manifest: Manifest
    manifest_sha256: str = ""

    @property
    def progress(self) -> dict[str, int]:
        return self.manifest.progress

    @property
    def size_bytes(self) -> int:
        return self.manifest.size_bytes

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.manifest.metadata.get("metrics") or {})

    @property
    def sharded(self) -> bool:
        """Written by ``checkpointing.commit.sharded`` (DCP shards, parallelism='fsdp'); readable without importing
        it (DCP takes ~0.1 s to import, which a run that never shards need not pay)."""
        return self.manifest.metadata.get("format") == SHARDED_FORMAT


@dataclass
class LoadedCheckpoint:
    info: CheckpointInfo
    objects: dict[str, Any]


def size_problem(size: int | None, entry: FileEntry) -> str:
    """What is wrong with a file of a checkpoint, listed with ``size`` (None: not there), against its manifest entry;
    empty when nothing is."""
    if size is None:
        return "missing"
    if size == NOT_A_FILE:
        return "a symbolic link or special file (never followed)"
    if size != entry.size:
        return f"size {size} != {entry.size} in manifest"
    return ""


class CheckpointStore:
    """The checkpoints of run ``run_name`` under ``save_folder`` (any fsspec URL)."""

    def __init__(
        self,
        save_folder: str,
        run_name: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetrySettings | None = None,
    ):
        validate_name(run_name)
        self.run_name = run_name
        folder = str(save_folder).rstrip("/")
        self.storage = Storage(f"{folder}/{run_name}", storage_options, retry, anchor=folder)
        self.uri = self.storage.url
        self.fence = Fence(self.storage)
        self._in_flight: set[str] = set()
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    # -- reading -------------------------------------------------------------------------------
    def list(self) -> builtins.list[CheckpointInfo]:
        """Checkpoints whose manifest exists and parses, oldest first (not yet verified)."""
        infos = [i for i in map(self.info, self.folders()) if i is not None]
        return sorted(infos, key=lambda i: i.manifest.order)

    def folders(self) -> builtins.list[str]:
        """Every folder under ``checkpoints/`` with a checkpoint name, sorted, its manifest readable or not (``list``
        gives only the readable; verify and the torn-folder sweep need the others too). Folders with other names (a
        person's ``ep1-ba8-sa256 copy``) are not the store's: left alone (never read, pruned or listed), reported
        once."""
        names = []
        for name in self.storage.list_dirs(CHECKPOINTS):
            if is_valid_name(name):
                names.append(name)
            else:
                self._warn_once(
                    f"{self.uri}/{CHECKPOINTS}/{printable(name)[:200]}",
                    "not a checkpoint name; this folder is not the store's and is left alone",
                )
        return sorted(names)

    def _warn_once(self, where: str, problem: str) -> None:
        if where not in self._warned:
            self._warned.add(where)
            log.warning("%s: %s", where, problem)

    def latest(self, deep: bool = False) -> CheckpointInfo | None:
        """The newest checkpoint that verifies.

        ``deep=False`` checks the manifest and every file's size; ``deep=True`` also hashes the files
        (``load`` always hashes, while it downloads)."""
        return next(self.candidates(deep), None)

    def check(self, checkpoint: str | CheckpointInfo, deep: bool = False) -> builtins.list[str]:
        """What is wrong with a checkpoint; an empty list means it verifies."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else self.info(checkpoint)
        if info is None:
            return [f"{checkpoint}: no readable {MANIFEST}"]
        return self._problems(info.name, info.manifest.files, deep)

    def _problems(self, name: str, files: dict[str, FileEntry], deep: bool) -> builtins.list[str]:
        prefix = self._key(name)
        found = self.storage.sizes(prefix)
        problems = []
        for fname, entry in files.items():
            wrong = size_problem(found.get(fname), entry)
            if wrong:
                problems.append(f"{name}/{fname}: {wrong}")
            elif deep and self.storage.get_hashed(f"{prefix}/{fname}")[1] != entry.sha256:
                problems.append(f"{name}/{fname}: sha256 mismatch")
        problems += [
            f"{name}/{printable(p)[:300]}: folders nested too deep to walk (damage)"
            for p, s in found.items()
            if s == TOO_DEEP
        ]
        return problems

    def load(self, checkpoint: str | CheckpointInfo, files: Iterable[str] | None = None) -> LoadedCheckpoint:
        """Downloads, verifies (hashing on the way) and safely unpickles a checkpoint's files."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else self.info(checkpoint)
        if info is None:
            raise CorruptCheckpointError(f"{self.uri}/{CHECKPOINTS}/{checkpoint}: no readable {MANIFEST}")
        wanted = list(info.manifest.files) if files is None else list(files)
        objects = {}
        for fname in wanted:
            entry = info.manifest.files.get(fname)
            if entry is None:
                continue
            data = read_vouched(self.storage, f"{self._key(info.name)}/{fname}", entry)
            objects[fname] = safe_load(data, f"{info.uri}/{fname}")
        if STATE_FILE in objects:
            _cross_check_progress(info, objects[STATE_FILE])
        return LoadedCheckpoint(info=info, objects=objects)

    def load_latest(self, files: Iterable[str] | None = None) -> LoadedCheckpoint | None:
        """Loads the newest good checkpoint, falling back past any whose files fail verification."""
        files = None if files is None else list(files)
        for info in self.candidates(deep=False):
            try:
                return self.load(info, files)
            except CorruptCheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", info.name, exc)
        return None

    def read_pointer(self) -> dict[str, Any] | None:
        """``latest`` as {"name", "generation", "manifest_sha256"}, or None when it is missing or damaged (then
        readers list every checkpoint, and the next writer repairs it: ``_repair_pointer``)."""
        try:
            return pointer.read(self.storage)
        except FileNotFoundError:
            return None
        except DamagedFileError as exc:
            log.warning("%s/%s is unreadable (%s); listing checkpoints instead", redact_uri(self.uri), POINTER, exc)
            return None

    def candidates(self, deep: bool = False) -> Iterator[CheckpointInfo]:
        """Checkpoints that verify, newest first by (generation, samples seen), rolled-back ones left out.

        ``latest`` is the fast path: only checkpoints whose name says they got further are read besides it
        (a process killed between its manifest and ``latest`` left one); without a usable ``latest``, every
        manifest is read."""
        names = self.folders()
        latest = self.read_pointer()
        head = self._pointed(latest, names) if latest else None
        roll_backs = self._roll_backs(latest, filter(None, [head]))
        first: builtins.list[str] = []
        if head is not None:
            samples = int(head.progress.get("samples_seen", 0))
            first = [head.name, *(n for n in names if may_be_past(n, head.name, samples))]
            infos = [head, *filter(None, map(self.info, first[1:]))]
            yield from self._verified(infos, deep, roll_backs)
        # Without a usable latest, or when nothing newer than it verifies: every other manifest, newest first.
        yield from self._verified(filter(None, map(self.info, (n for n in names if n not in first))), deep, roll_backs)

    def _verified(self, infos: Iterable[CheckpointInfo], deep: bool, roll_backs: RollBacks) -> Iterator[CheckpointInfo]:
        for info in sorted(infos, key=lambda i: i.manifest.order, reverse=True):
            if roll_backs.sets_aside(info.manifest):
                continue
            problems = self.check(info, deep)
            if problems:
                log.warning("skipping checkpoint %s: %s", info.name, "; ".join(problems))
                continue
            yield info

    def _pointed(self, latest: dict[str, Any], names: builtins.list[str]) -> CheckpointInfo | None:
        """The checkpoint ``latest`` names, if its manifest is readable and the one ``latest`` vouches for."""
        name = latest["name"]
        info = self.info(name) if name in names else None
        if info is None:
            problem = f"which has no readable {MANIFEST}" if name in names else "which does not exist"
        elif latest["manifest_sha256"] and info.manifest_sha256 != latest["manifest_sha256"]:
            problem = "whose manifest is not the one latest vouches for"
        else:
            return info
        log.warning("latest names %s, %s; looking for the newest good checkpoint", name, problem)
        return None

    def _roll_backs(self, latest: dict[str, Any] | None, infos: Iterable[CheckpointInfo] = ()) -> RollBacks:
        """The run's roll-backs: its trusted records, and ``latest`` as a witness of the last one (rollbacks.py).
        The checkpoint ``latest`` names is looked up among ``infos`` (already read), else read."""
        head = None
        if latest is not None:
            named = [i for i in infos if i.name == latest["name"]] or list(filter(None, [self.info(latest["name"])]))
            head = next((i for i in named if latest["manifest_sha256"] in ("", i.manifest_sha256)), None)
        witness = rollbacks.witness(latest["generation"], head.name, head.manifest) if latest and head else None
        return rollbacks.read_all(self.storage, self._manifest_of, witness, self._warn_once)

    def _manifest_of(self, name: str) -> Manifest | None:
        info = self.info(name)
        return info.manifest if info is not None else None

    # -- writing -------------------------------------------------------------------------------
    def save(
        self,
        name: str,
        objects: dict[str, Any],
        *,
        progress: dict[str, int],
        metadata: dict[str, Any] | None = None,
        writer: Writer | None = None,
    ) -> CheckpointInfo:
        """Serializes ``objects`` (file name -> object for ``torch.save``) and commits them."""
        return self.commit(name, serialize(objects), progress=progress, metadata=metadata, writer=writer)

    def commit(
        self,
        name: str,
        blobs: dict[str, bytes],
        *,
        progress: dict[str, int],
        metadata: dict[str, Any] | None = None,
        writer: Writer | None = None,
    ) -> CheckpointInfo:
        """Writes files, checks what landed, then writes the manifest, then moves ``latest``.

        Raises FencedError for a stale writer, CorruptCheckpointError if the files do not verify right after
        they were written (then no manifest is written and ``latest`` stays where it was)."""
        validate_name(name, "checkpoint name")
        for fname in blobs:
            validate_file_name(fname)
        writer = writer or Writer.current()
        self.check_fence(writer)
        prefix = self._key(name)
        self._in_flight.add(name)
        _WRITING.add((self.uri, name))
        entries = {f: in_background(describe, d) for f, d in blobs.items()}  # hashed while the files upload
        try:
            self.storage.delete(f"{prefix}/{MANIFEST}")  # a re-save first un-commits the old copy
            for fname, data in blobs.items():
                self.storage.put(f"{prefix}/{fname}", data)
            return self._publish(name, {f: e.result() for f, e in entries.items()}, progress, metadata, writer)
        finally:
            self._in_flight.discard(name)
            _WRITING.discard((self.uri, name))

    def begin_commit(self, name: str, writer: Writer) -> None:
        """The first step of a commit whose files others write (streamed, or DCP shards of several ranks) and
        ``commit_files`` finishes: checks the fence (a stale writer writes nothing), un-commits a checkpoint of the
        same name and removes its files (a retry at another world size would otherwise leave stray shards), and
        marks the folder as being written (the torn-folder sweep leaves it alone)."""
        validate_name(name, "checkpoint name")
        self.check_fence(writer)
        self.delete(name)
        _WRITING.add((self.uri, name))  # until commit_files ends (a write that fails before leaves it: kept here)

    def commit_files(
        self,
        name: str,
        entries: dict[str, FileEntry],
        *,
        progress: dict[str, int],
        metadata: dict[str, Any] | None = None,
        writer: Writer | None = None,
    ) -> CheckpointInfo:
        """The last step of a commit that ``begin_commit`` began: checks that the files already written under
        ``checkpoints/<name>/`` (by several processes, or streamed) landed as ``entries`` says, then writes the
        manifest and moves ``latest``, fenced, as ``commit`` does after its own writes."""
        validate_name(name, "checkpoint name")
        for fname in entries:
            validate_file_name(fname)
        writer = writer or Writer.current()
        self.check_fence(writer)
        self._in_flight.add(name)
        try:
            return self._publish(name, entries, progress, metadata, writer)
        finally:
            self._in_flight.discard(name)
            _WRITING.discard((self.uri, name))

    def _publish(
        self,
        name: str,
        entries: dict[str, FileEntry],
        progress: dict[str, int],
        metadata: dict[str, Any] | None,
        writer: Writer,
    ) -> CheckpointInfo:
        """Checks that every file landed whole, then writes the manifest and (if this writer is still
        current) moves ``latest``."""
        problems = self._problems(name, entries, deep=False)
        if problems:
            raise CorruptCheckpointError(
                f"checkpoint {name} did not verify right after it was written ({'; '.join(problems)}); "
                f"it was not committed and 'latest' was not moved"
            )
        manifest = Manifest(
            name=name, files=dict(entries), progress=dict(progress), metadata=dict(metadata or {}), writer=writer
        )
        body = manifest.to_json()
        try:  # what every reader will check: a run never commits a manifest it could not read back
            Manifest.from_json(body)
        except ManifestError as exc:
            raise CheckpointError(
                f"checkpoint {name}: readers would refuse its manifest ({exc}); it was not committed (fewer files "
                f"per checkpoint, or flatter recipe_args and metadata)"
            ) from exc
        prefix = self._key(name)
        self.storage.put(f"{prefix}/{MANIFEST}", body)
        info = CheckpointInfo(name, self.storage.uri(prefix), manifest, sha256_hex(body))
        self.check_fence(writer)
        pointer.write(self.storage, name, writer.generation, info.manifest_sha256)
        return info

    def name_for(self, progress: dict[str, int], generation: int) -> str:
        """The name of a checkpoint at ``progress`` (``ep<epoch>-ba<step>-sa<samples>``), or that name with
        ``-g<generation>`` when an older writer's committed checkpoint holds it (after a roll-back or a fall-back,
        retraining reaches the same position; nothing is overwritten). The only place names are made."""
        base = checkpoint_name(progress)
        existing = self.info(base)
        if existing is None or existing.manifest.writer.generation == generation:
            return base
        return f"{base}-g{generation}"

    def prune(self, keep: int, score_attribute: str | None = None, score_order: str = "max") -> builtins.list[str]:
        """Deletes all checkpoints but the ``keep`` newest, or with ``score_attribute`` all but the ``keep`` best by
        that metric of the manifest's ``metadata["metrics"]`` (``score_order`` "max" or "min"; checkpoints without
        it rank last) *and* the newest. Never deletes the one ``latest`` names (a resume needs it), one in flight,
        or one a roll-back set aside (kept as a record). So ``keep=1`` with a score keeps the best and the newest
        (Ray's ``num_to_keep`` with a score; Lightning's ``save_top_k`` plus ``last``), never one for the other."""
        if keep < 0:
            return []
        latest, infos = self.read_pointer(), self.list()
        roll_backs = self._roll_backs(latest, infos)
        protected = set(self._in_flight) | ({latest["name"]} if latest else set())
        # Deleting is for good: while a damaged roll-back record is there, what it may have set aside stays.
        protected |= {i.name for i in infos if roll_backs.may_have_set_aside(i.manifest)}
        ranked = [i for i in reversed(infos) if not roll_backs.sets_aside(i.manifest)]  # newest first
        if score_attribute:
            best = sorted(ranked, key=lambda i: _score(i, score_attribute, score_order))[:keep]  # stable: ties newest
            kept = {i.name for i in best} | protected | {i.name for i in ranked[:1]}
        else:
            kept = set(protected)  # the newest ``keep``, counting the one latest names
            for info in ranked:
                if len(kept) >= keep:
                    break
                kept.add(info.name)
        deleted = []
        for info in ranked:
            if info.name not in kept:
                self.delete(info.name)
                deleted.append(info.name)
        return deleted

    def delete(self, name: str) -> None:
        """Un-commits (manifest first) and then removes a checkpoint."""
        validate_name(name, "checkpoint name")
        self.storage.delete(f"{self._key(name)}/{MANIFEST}")
        self.storage.delete(self._key(name), recursive=True)

    # -- best, roll-back, fencing ---------------------------------------------------------------
    def best(self, attribute: str, order: str = "max") -> builtins.list[CheckpointInfo]:
        """Checkpoints that report ``attribute`` in their metrics, best first (ties: newest first)."""
        infos = self.list()
        roll_backs = self._roll_backs(self.read_pointer(), infos)
        scored = [i for i in reversed(infos) if attribute in i.metrics and not roll_backs.sets_aside(i.manifest)]
        return sorted(scored, key=lambda i: _score(i, attribute, order))

    def rollbacks(self) -> builtins.list[dict[str, Any]]:
        """The run's roll-backs, oldest first, as {"generation", "to", "order"}: its trusted records, and ``latest``
        while it is the pointer a roll-back left (rollbacks.py). Damaged records are reported and left out."""
        return [rb.as_dict() for rb in self._roll_backs(self.read_pointer(), []).records]

    def set_aside(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[str]:
        """Names of the checkpoints that roll-backs set aside (kept, never candidates), in the order of ``infos``
        (default: ``list()``, oldest first)."""
        infos = self.list() if infos is None else builtins.list(infos)
        roll_backs = self._roll_backs(self.read_pointer(), infos)
        return [i.name for i in infos if roll_backs.sets_aside(i.manifest)]

    def roll_back(self, to: str, writer: Writer) -> builtins.list[str]:
        """Makes checkpoint ``to`` the run's newest: checkpoints of older writers that got further stop being
        candidates (recorded under rollbacks/, never deleted). Returns their names. ``to`` must verify deeply."""
        info = self.info(validate_name(to, "resume_from"))
        problems = self.check(info, deep=True) if info else [f"{to}: no readable {MANIFEST}"]
        if info is None or problems:
            raise NotACheckpointError(
                f"resume_from={to!r}: no checkpoint of that name verifies ({'; '.join(problems)})"
            )
        if self.set_aside([info]):
            raise NotACheckpointError(
                f"resume_from={to!r}: an earlier roll-back set that checkpoint aside, and it cannot be resumed from "
                f"in this run; start a new run from it with load_path={info.uri!r}"
            )
        self.check_fence(writer)
        later = [i.name for i in self.list() if i.manifest.order > info.manifest.order]
        self.storage.put(*rollbacks.record(writer.generation, to, info.manifest.order, later))
        pointer.write(self.storage, to, writer.generation, info.manifest_sha256)
        return later

    def claim_generation(self, label: str = "", owner: str = "", handover_seconds: float = 0.0) -> int:
        """Claims a writer generation higher than any claimed before (see fencing.py); with ``handover_seconds``, a
        live previous holder is first asked to commit where it stands and stop. First it repairs ``latest`` if it
        is damaged (``_repair_pointer``): every flow start and torchrun unit claims, so the first writer of a
        relaunch repairs what a kill left, and the repaired pointer's generation is the claim's floor again. Once
        claimed, it removes the folders older writers began and never committed (torn.py)."""
        self._repair_pointer()
        floor = (self.read_pointer() or {}).get("generation", 0)
        generation = self.fence.claim(floor=floor, label=label, owner=owner, handover_seconds=handover_seconds)
        writing = self._in_flight | {name for uri, name in set(_WRITING) if uri == self.uri}
        try:
            torn.remove_fenced_out(self, generation, writing)
        except Exception as exc:  # best effort: they are never read, and the next writer tries again
            log.warning(
                "%s: could not remove torn checkpoint folders of earlier writers: %s", redact_uri(self.uri), exc
            )
        return generation

    def _repair_pointer(self) -> str | None:
        """Rewrites ``latest`` when it is there but unreadable (empty after a kill mid-write, torn, altered) or
        names no checkpoint whose manifest it vouches for, and a checkpoint verifies: ``latest`` then names
        the newest one, with that checkpoint's writer generation (as its commit would have). Readers never
        write: they list every checkpoint meanwhile. ``claim_generation`` calls it; returns the name written."""
        try:
            latest: dict[str, Any] | None = pointer.read(self.storage)
        except FileNotFoundError:
            return None  # a new run, or one whose latest was never written: nothing to repair
        except DamagedFileError:
            latest = None
        if latest is not None and self._pointed(latest, self.folders()) is not None:
            return None
        newest = self.latest()
        if newest is None:
            return None
        log.warning(
            "%s/%s: rewriting it to name %s, the newest checkpoint that verifies",
            redact_uri(self.uri),
            POINTER,
            newest.name,
        )
        pointer.write(self.storage, newest.name, newest.manifest.writer.generation, newest.manifest_sha256)
        return newest.name

    def check_fence(self, writer: Writer) -> None:
        self.fence.check(writer, (self.read_pointer() or {}).get("generation", 0))

    # -- helpers -------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{CHECKPOINTS}/{name}"

    def info(self, name: str) -> CheckpointInfo | None:
        """The checkpoint as its manifest describes it (not verified), or None without a readable manifest."""
        try:
            body = self.storage.get(f"{self._key(name)}/{MANIFEST}", max_bytes=MAX_MANIFEST_BYTES)
            manifest = Manifest.from_json(body)
        except FileNotFoundError:
            return None
        except ManifestError as exc:
            log.warning("checkpoint %s: %s", redact_uri(self.storage.uri(self._key(name))), exc)
            return None
        return CheckpointInfo(name, self.storage.uri(self._key(name)), manifest, sha256_hex(body))


def read_vouched(storage: Storage, key: str, entry: FileEntry) -> bytes:
    """Reads ``key`` once, hashing as it arrives; CorruptCheckpointError unless size and sha256 match ``entry``.
    A local link or special file reads as missing."""
    try:
        data, digest = storage.get_hashed(key, max_bytes=entry.size)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{storage.uri(key)}: missing ({exc})") from exc
    if len(data) != entry.size or digest != entry.sha256:
        raise CorruptCheckpointError(
            f"{storage.uri(key)}: {len(data)} bytes, sha256 {digest[:12]}… does not match the manifest "
            f"({entry.size} bytes, {entry.sha256[:12]}…)"
        )
    return data


def _cross_check_progress(info: CheckpointInfo, state: Any) -> None:
    """``state.pt`` carries its own copy of the progress counters: it must agree with the manifest."""
    copy = state.get("progress") if isinstance(state, dict) else None
    if not isinstance(copy, dict):
        return
    differing = sorted(k for k in info.progress if k in copy and not _same_count(copy[k], info.progress[k]))
    if differing:
        theirs = ", ".join(f"{k}={printable(copy[k])[:40]}" for k in differing)  # from the file: escaped, cut short
        raise CorruptCheckpointError(
            f"{info.uri}: the manifest's progress ({', '.join(f'{k}={info.progress[k]}' for k in differing)}) "
            f"disagrees with the copy inside {STATE_FILE} ({theirs})"
        )


def _same_count(value: Any, expected: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) == expected


def _score(info: CheckpointInfo, attribute: str, order: str) -> tuple[int, float]:
    """Sort key, best first."""
    value = info.metrics.get(attribute)
    if value is None:
        return (1, 0.0)
    return (0, -float(value) if order == "max" else float(value))
