"""CheckpointStore: the checkpoints of one run in an object store, committed so that nothing torn is read.

Layout under ``<save_folder>/<run_name>/``::

    checkpoints/<name>/state.pt        model/optimizer/scheduler state; weights at ["state"]["model"]
    checkpoints/<name>/rng-rank<r>.pt  per-rank RNG states
    checkpoints/<name>/manifest.json   size + sha256 of every file above, progress, writer; written last
    latest                             {"name", "generation", "manifest_sha256"}; moved only after the manifest
    claims/<generation>                one per writer (fencing.py)
    rollbacks/<generation>.json        a ``resume_from`` roll-back: later checkpoints stop being candidates

Commit order is files, then manifest, then ``latest``. A reader takes the newest checkpoint that verifies,
newest by (writer generation, samples seen): ``latest`` is the fast path, and a checkpoint committed after
it (a process killed between its manifest and ``latest``) is found by its name. Loading reads each file
once, hashing it as it arrives, cross-checks the progress copy inside ``state.pt`` against the manifest,
and refuses anything ``torch.load(weights_only=True)`` would not load safely.
"""

from __future__ import annotations

import builtins
import json
import logging
import numbers
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from checkpointing.fencing import Fence, FencedError
from checkpointing.hashing import in_background, sha256_hex
from checkpointing.localfs import NOT_A_FILE
from checkpointing.manifest import MANIFEST, FileEntry, Manifest, ManifestError, Writer, describe
from checkpointing.serialization import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    safe_load,
    serialize,
)
from checkpointing.storage import RetrySettings, Storage
from checkpointing.untrusted import printable

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
POINTER = "latest"
CHECKPOINTS = "checkpoints"
ROLLBACKS = "rollbacks"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILE = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,127}$")
_SAMPLES_IN_NAME = re.compile(r"-sa(\d+)(?:-g\d+)?$")

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CorruptCheckpointError",
    "FencedError",
    "LoadedCheckpoint",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "serialize",
]


class NotACheckpointError(CheckpointError, ValueError):
    """A URI given as a checkpoint names no checkpoint or run."""


def validate_name(value: str, option: str = "run_name") -> str:
    """Names become path segments: reject separators, '..', absolute paths and odd characters."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise ValueError(
            f"{option}={value!r}: use 1-128 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (no '/', '..' or absolute paths)"
        )
    return value


def validate_file_name(value: str) -> str:
    """A file of a checkpoint: one path segment; DCP's own names (``.metadata``, ``__0_0.distcp``) included."""
    if not isinstance(value, str) or not _FILE.match(value) or ".." in value:
        raise ValueError(f"checkpoint file name {value!r}: use 1-128 letters, digits, '.', '_' or '-' (no '/' or '..')")
    return value


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


@dataclass
class LoadedCheckpoint:
    info: CheckpointInfo
    objects: dict[str, Any]


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

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    # -- reading -------------------------------------------------------------------------------
    def list(self) -> builtins.list[CheckpointInfo]:
        """Checkpoints whose manifest exists and parses, oldest first (not yet verified)."""
        infos = [i for i in map(self.info, self.storage.list_dirs(CHECKPOINTS)) if i is not None]
        return sorted(infos, key=lambda i: i.manifest.order)

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
            size = found.get(fname)
            if size is None:
                problems.append(f"{name}/{fname}: missing")
            elif size == NOT_A_FILE:
                problems.append(f"{name}/{fname}: a symbolic link or special file (never followed)")
            elif size != entry.size:
                problems.append(f"{name}/{fname}: size {size} != {entry.size} in manifest")
            elif deep and self.storage.get_hashed(f"{prefix}/{fname}")[1] != entry.sha256:
                problems.append(f"{name}/{fname}: sha256 mismatch")
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
        try:
            raw = json.loads(self.storage.get(POINTER))
            # The name becomes a path: one like '../other-run/...' must not lead the reader out of this run.
            return {
                "name": validate_name(str(raw["name"]), "latest name"),
                "generation": int(raw.get("generation", 0)),
                "manifest_sha256": str(raw.get("manifest_sha256", "")),
            }
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s/%s is unreadable (%s); listing checkpoints instead", self.uri, POINTER, exc)
            return None

    def candidates(self, deep: bool = False) -> Iterator[CheckpointInfo]:
        """Checkpoints that verify, newest first by (generation, samples seen), rolled-back ones left out.

        ``latest`` is the fast path: only checkpoints whose name says they got further are read besides it
        (a process killed between its manifest and ``latest`` left one); without a usable ``latest``, every
        manifest is read."""
        names = self.storage.list_dirs(CHECKPOINTS)
        pointer = self.read_pointer()
        head = self._pointed(pointer, names) if pointer else None
        rollbacks = self.rollbacks()
        first: builtins.list[str] = []
        if head is not None:
            samples = int(head.progress.get("samples_seen", 0))
            first = [head.name, *(n for n in names if _may_be_past(n, head.name, samples))]
            infos = [head, *filter(None, map(self.info, first[1:]))]
            yield from self._verified(infos, deep, rollbacks)
        # Without a usable latest, or when nothing newer than it verifies: every other manifest, newest first.
        yield from self._verified(filter(None, map(self.info, (n for n in names if n not in first))), deep, rollbacks)

    def _verified(self, infos: Iterable[CheckpointInfo], deep: bool, rollbacks: builtins.list[dict[str, Any]]):
        for info in sorted(infos, key=lambda i: i.manifest.order, reverse=True):
            if _rolled_back(info, rollbacks):
                continue
            problems = self.check(info, deep)
            if problems:
                log.warning("skipping checkpoint %s: %s", info.name, "; ".join(problems))
                continue
            yield info

    def _pointed(self, pointer: dict[str, Any], names: builtins.list[str]) -> CheckpointInfo | None:
        """The checkpoint ``latest`` names, if its manifest is readable and the one ``latest`` vouches for."""
        name = pointer["name"]
        info = self.info(name) if name in names else None
        if info is None:
            problem = f"which has no readable {MANIFEST}" if name in names else "which does not exist"
        elif pointer["manifest_sha256"] and info.manifest_sha256 != pointer["manifest_sha256"]:
            problem = "whose manifest is not the one latest vouches for"
        else:
            return info
        log.warning("latest names %s, %s; looking for the newest good checkpoint", name, problem)
        return None

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
        entries = {f: in_background(describe, d) for f, d in blobs.items()}  # hashed while the files upload
        try:
            self.storage.delete(f"{prefix}/{MANIFEST}")  # a re-save first un-commits the old copy
            for fname, data in blobs.items():
                self.storage.put(f"{prefix}/{fname}", data)
            return self._publish(name, {f: e.result() for f, e in entries.items()}, progress, metadata, writer)
        finally:
            self._in_flight.discard(name)

    def begin(self, name: str, writer: Writer) -> None:
        """Makes way for files that ``commit_files`` will commit: checks the fence (a stale writer writes
        nothing), un-commits a checkpoint of the same name and removes its files (a retry at another world
        size would otherwise leave stray shards)."""
        validate_name(name, "checkpoint name")
        self.check_fence(writer)
        self.delete(name)

    def commit_files(
        self,
        name: str,
        entries: dict[str, FileEntry],
        *,
        progress: dict[str, int],
        metadata: dict[str, Any] | None = None,
        writer: Writer | None = None,
    ) -> CheckpointInfo:
        """Commits files already written under ``checkpoints/<name>/`` (by several processes, or streamed),
        as ``commit`` does after its own writes."""
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
        prefix = self._key(name)
        self.storage.put(f"{prefix}/{MANIFEST}", body)
        info = CheckpointInfo(name, self.storage.uri(prefix), manifest, sha256_hex(body))
        self.check_fence(writer)
        pointer = {"name": name, "generation": writer.generation, "manifest_sha256": info.manifest_sha256}
        self.storage.put(POINTER, json.dumps(pointer).encode())
        return info

    def name_for(self, base: str, generation: int) -> str:
        """``base``, or ``base-g<generation>`` when an older writer's committed checkpoint holds that name
        (after a roll-back or a fall-back, retraining reaches the same position; nothing is overwritten)."""
        existing = self.info(base)
        if existing is None or existing.manifest.writer.generation == generation:
            return base
        return f"{base}-g{generation}"

    def prune(self, keep: int, score_attribute: str | None = None, score_order: str = "max") -> builtins.list[str]:
        """Deletes all but ``keep`` checkpoints; never the one ``latest`` names, one in flight, or one that a
        roll-back set aside (those are kept as a record).

        Keeps the newest, or with ``score_attribute`` the best by that metric of the manifest's
        ``metadata["metrics"]`` (``score_order`` "max" or "min"; checkpoints without it rank last)."""
        if keep < 0:
            return []
        pointer = self.read_pointer()
        protected = set(self._in_flight) | ({pointer["name"]} if pointer else set())
        rollbacks = self.rollbacks()
        ranked = [i for i in reversed(self.list()) if not _rolled_back(i, rollbacks)]  # newest first
        if score_attribute:
            ranked.sort(key=lambda i: _score(i, score_attribute, score_order))  # stable: ties stay newest first
        kept = [i.name for i in ranked if i.name in protected]
        deleted = []
        for info in ranked:
            if info.name in protected:
                continue
            if len(kept) < keep:
                kept.append(info.name)
                continue
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
        rollbacks = self.rollbacks()
        scored = [i for i in reversed(self.list()) if attribute in i.metrics and not _rolled_back(i, rollbacks)]
        return sorted(scored, key=lambda i: _score(i, attribute, order))

    def rollbacks(self) -> builtins.list[dict[str, Any]]:
        found = []
        for fname in self.storage.sizes(ROLLBACKS) if self.storage.exists(ROLLBACKS) else {}:
            try:
                raw = json.loads(self.storage.get(f"{ROLLBACKS}/{fname}"))
                found.append({"generation": int(raw["generation"]), "to": str(raw["to"]), "order": raw["order"]})
            except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
                log.warning("%s/%s/%s is unreadable (%s); ignoring it", self.uri, ROLLBACKS, fname, exc)
        return found

    def set_aside(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[str]:
        """Names of the checkpoints that roll-backs set aside (kept, never candidates), in the order of ``infos``
        (default: ``list()``, oldest first)."""
        rollbacks = self.rollbacks()
        if not rollbacks:
            return []
        return [i.name for i in (self.list() if infos is None else infos) if _rolled_back(i, rollbacks)]

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
        record = {"generation": writer.generation, "to": to, "order": list(info.manifest.order), "set_aside": later}
        self.storage.put(f"{ROLLBACKS}/{writer.generation:012d}.json", json.dumps(record, indent=1).encode())
        pointer = {"name": to, "generation": writer.generation, "manifest_sha256": info.manifest_sha256}
        self.storage.put(POINTER, json.dumps(pointer).encode())
        return later

    def claim_generation(self, label: str = "") -> int:
        """Claims a writer generation higher than any claimed before (see fencing.py)."""
        return self.fence.claim(floor=(self.read_pointer() or {}).get("generation", 0), label=label)

    def check_fence(self, writer: Writer) -> None:
        self.fence.check(writer, (self.read_pointer() or {}).get("generation", 0))

    # -- helpers -------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{CHECKPOINTS}/{name}"

    def info(self, name: str) -> CheckpointInfo | None:
        """The checkpoint as its manifest describes it (not verified), or None without a readable manifest."""
        try:
            body = self.storage.get(f"{self._key(name)}/{MANIFEST}")
            manifest = Manifest.from_json(body)
        except FileNotFoundError:
            return None
        except ManifestError as exc:
            log.warning("checkpoint %s: %s", self.storage.uri(self._key(name)), exc)
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


def _may_be_past(name: str, head: str, head_samples: int) -> bool:
    """Whether checkpoint ``name`` may be newer than ``head``: its name says it saw more samples (or says
    nothing). Reading only those keeps resolving cheap in a run with thousands of checkpoints."""
    if name == head:
        return False
    m = _SAMPLES_IN_NAME.search(name)
    return m is None or int(m.group(1)) > head_samples


def _rolled_back(info: CheckpointInfo, rollbacks: list[dict[str, Any]]) -> bool:
    """Set aside by a roll-back: written by an older generation than the roll-back, and got further than its target."""
    return any(
        info.manifest.writer.generation < rb["generation"] and list(info.manifest.order) > list(rb["order"])
        for rb in rollbacks
    )


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


def split_run_uri(uri: str) -> tuple[str, str, str | None]:
    """``<save_folder>/<run_name>[/checkpoints/<name>[/manifest.json]]`` -> (save_folder, run_name, name)."""
    uri = str(uri).rstrip("/").removesuffix(f"/{MANIFEST}").rstrip("/")
    name = None
    if f"/{CHECKPOINTS}/" in uri:
        uri, name = uri.rsplit(f"/{CHECKPOINTS}/", 1)
    if "/" not in uri:
        raise NotACheckpointError(f"{uri!r}: give <save_folder>/<run_name>, e.g. runs/exp1 or s3://bucket/runs/exp1")
    folder, run = uri.rsplit("/", 1)
    return folder, run, name


def open_checkpoint_uri(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    option: str = "load_path",
) -> LoadedCheckpoint:
    """Loads a checkpoint named by URI: a checkpoint folder, or a run folder (its latest good one)."""
    try:
        folder, run, name = split_run_uri(uri)
        store = CheckpointStore(folder, validate_name(run, option), storage_options=storage_options)
    except ValueError as exc:
        raise NotACheckpointError(f"{option}={uri!r}: {exc}") from exc
    if name is not None:
        if store.info(validate_name(name, option)) is None:
            raise NotACheckpointError(f"{option}={uri!r}: no checkpoint with a readable {MANIFEST} there")
        return store.load(name, files)
    if store.storage.exists(POINTER) or store.storage.exists(CHECKPOINTS):
        loaded = store.load_latest(files)
        if loaded is not None:
            return loaded
        raise NotACheckpointError(f"{option}={uri!r}: the run there has no checkpoint that verifies")
    raise NotACheckpointError(
        f"{option}={uri!r}: neither a checkpoint folder (with {MANIFEST}) nor a run folder "
        f"(with '{POINTER}' or '{CHECKPOINTS}/'); point it at <save_folder>/<run_name> or "
        f"<save_folder>/<run_name>/{CHECKPOINTS}/<name>"
    )
