"""CheckpointStore: the checkpoints of one run in an object store, committed so that nothing torn is read.

Layout under ``<save_folder>/<run_name>/``::

    checkpoints/<name>/state.pt        model/optimizer/scheduler state; weights at ["state"]["model"]
    checkpoints/<name>/rng-rank<r>.pt  per-rank RNG states
    checkpoints/<name>/manifest.json   size + sha256 of every file above, progress, writer; written last
    latest                             {"name", "generation"}; moved only after the manifest is written

Commit order is files, then manifest, then ``latest``. A reader trusts ``latest`` only if the checkpoint
it names verifies; otherwise it lists manifests and takes the newest one that verifies. Loading reads
each file once, hashing it chunk by chunk as it arrives, and refuses anything ``torch.load(weights_only=True)`` would not load
safely, so a checkpoint from a shared bucket cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from checkpointing.manifest import MANIFEST, Manifest, ManifestError, Writer, describe
from checkpointing.storage import RetrySettings, Storage

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
POINTER = "latest"
CHECKPOINTS = "checkpoints"
CLAIMS = "claims"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CheckpointError(RuntimeError):
    """Base class for checkpoint problems."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match what its manifest vouches for."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something that only an unsafe (code-running) unpickler could load."""


class NotACheckpointError(CheckpointError, ValueError):
    """A URI given as a checkpoint names no checkpoint or run."""


class FencedError(CheckpointError):
    """A newer writer generation owns this run; this writer must stop."""


def validate_name(value: str, option: str = "run_name") -> str:
    """Names become path segments: reject separators, '..', absolute paths and odd characters."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise ValueError(
            f"{option}={value!r}: use 1-128 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (no '/', '..' or absolute paths)"
        )
    return value


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    name: str
    uri: str
    manifest: Manifest

    @property
    def progress(self) -> dict[str, int]:
        return self.manifest.progress

    @property
    def size_bytes(self) -> int:
        return self.manifest.size_bytes


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
        self.storage = Storage(f"{str(save_folder).rstrip('/')}/{run_name}", storage_options, retry)
        self.uri = self.storage.url
        self._in_flight: set[str] = set()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    # -- reading -------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Checkpoints whose manifest exists and parses, oldest first (not yet verified)."""
        infos = []
        for name in self.storage.list_dirs(CHECKPOINTS):
            info = self._info(name)
            if info is not None:
                infos.append(info)
        return sorted(infos, key=lambda i: i.manifest.order)

    def latest(self, deep: bool = False) -> CheckpointInfo | None:
        """The newest checkpoint that verifies: ``latest`` if it does, else the newest listed one.

        ``deep=False`` checks the manifest and every file's size; ``deep=True`` also hashes the files
        (``load`` always hashes, while it downloads).
        """
        return next(iter(self._candidates(deep)), None)

    def check(self, checkpoint: str | CheckpointInfo, deep: bool = False) -> list[str]:
        """What is wrong with a checkpoint; an empty list means it verifies."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else self._info(checkpoint)
        if info is None:
            return [f"{checkpoint}: no readable {MANIFEST}"]
        prefix = self._key(info.name)
        found = self.storage.sizes(prefix)
        problems = []
        for fname, entry in info.manifest.files.items():
            if fname not in found:
                problems.append(f"{info.name}/{fname}: missing")
            elif found[fname] != entry.size:
                problems.append(f"{info.name}/{fname}: size {found[fname]} != {entry.size} in manifest")
            elif deep and _sha256(self.storage.get(f"{prefix}/{fname}")) != entry.sha256:
                problems.append(f"{info.name}/{fname}: sha256 mismatch")
        return problems

    def load(self, checkpoint: str | CheckpointInfo, files: Iterable[str] | None = None) -> LoadedCheckpoint:
        """Downloads, verifies (hashing on the way) and safely unpickles a checkpoint's files."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else self._info(checkpoint)
        if info is None:
            raise CorruptCheckpointError(f"{self.uri}/{CHECKPOINTS}/{checkpoint}: no readable {MANIFEST}")
        wanted = list(info.manifest.files) if files is None else list(files)
        objects = {}
        for fname in wanted:
            entry = info.manifest.files.get(fname)
            if entry is None:
                continue
            data, digest = self._read_verified(info, fname)
            if len(data) != entry.size or digest != entry.sha256:
                raise CorruptCheckpointError(
                    f"{info.uri}/{fname}: {len(data)} bytes, sha256 {digest[:12]}… does not match the "
                    f"manifest ({entry.size} bytes, {entry.sha256[:12]}…)"
                )
            objects[fname] = safe_load(data, f"{info.uri}/{fname}")
        return LoadedCheckpoint(info=info, objects=objects)

    def _read_verified(self, info: CheckpointInfo, fname: str) -> tuple[bytes, str]:
        """One read of a file and its sha256, hashed while reading (never a second pass over the store)."""
        try:
            return self.storage.get_hashed(f"{self._key(info.name)}/{fname}")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{info.uri}/{fname}: missing") from exc

    def load_latest(self, files: Iterable[str] | None = None) -> LoadedCheckpoint | None:
        """Loads the newest good checkpoint, falling back past any whose files fail verification."""
        files = None if files is None else list(files)
        for info in self._candidates(deep=False):
            try:
                return self.load(info, files)
            except CorruptCheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", info.name, exc)
        return None

    def read_pointer(self) -> dict[str, Any] | None:
        try:
            raw = json.loads(self.storage.get(POINTER))
            # The name becomes a path: one like '../other-run/...' must not lead the reader out of this run.
            return {"name": validate_name(str(raw["name"]), "latest name"), "generation": int(raw.get("generation", 0))}
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s/%s is unreadable (%s); listing checkpoints instead", self.uri, POINTER, exc)
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
        """Writes files, then the manifest, then moves ``latest``. Raises FencedError for stale writers."""
        validate_name(name, "checkpoint name")
        for fname in blobs:
            validate_name(fname, "checkpoint file name")
        writer = writer or Writer.current()
        self._check_fence(writer)
        prefix = self._key(name)
        self._in_flight.add(name)
        entries = {f: _HASHER.submit(describe, d) for f, d in blobs.items()}  # hashed while the files upload
        try:
            self.storage.delete(f"{prefix}/{MANIFEST}")  # a re-save first un-commits the old copy
            for fname, data in blobs.items():
                self.storage.put(f"{prefix}/{fname}", data)
            manifest = Manifest(
                name=name,
                files={f: e.result() for f, e in entries.items()},
                progress=dict(progress),
                metadata=dict(metadata or {}),
                writer=writer,
            )
            self.storage.put(f"{prefix}/{MANIFEST}", manifest.to_json())
            self._check_fence(writer)
            self.storage.put(POINTER, json.dumps({"name": name, "generation": writer.generation}).encode())
        finally:
            self._in_flight.discard(name)
        return CheckpointInfo(name=name, uri=self.storage.uri(prefix), manifest=manifest)

    def prune(self, keep: int, score_attribute: str | None = None, score_order: str = "max") -> list[str]:
        """Deletes all but ``keep`` checkpoints; never the one ``latest`` names or one in flight.

        Keeps the newest, or with ``score_attribute`` the best by that metric of the manifest's
        ``metadata["metrics"]`` (``score_order`` "max" or "min"; checkpoints without it rank last)."""
        if keep < 0:
            return []
        pointer = self.read_pointer()
        protected = set(self._in_flight) | ({pointer["name"]} if pointer else set())
        ranked = list(reversed(self.list()))  # newest first
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

    # -- helpers -------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{CHECKPOINTS}/{name}"

    def _info(self, name: str) -> CheckpointInfo | None:
        try:
            manifest = Manifest.from_json(self.storage.get(f"{self._key(name)}/{MANIFEST}"))
        except FileNotFoundError:
            return None
        except ManifestError as exc:
            log.warning("checkpoint %s: %s", self.storage.uri(self._key(name)), exc)
            return None
        return CheckpointInfo(name=name, uri=self.storage.uri(self._key(name)), manifest=manifest)

    def _candidates(self, deep: bool):
        """Checkpoints that verify, best first: the one ``latest`` names, then newest to oldest."""
        pointer = self.read_pointer()
        tried = set()
        if pointer is not None:
            tried.add(pointer["name"])
            info = self._info(pointer["name"])
            problems = self.check(info, deep) if info else [f"{pointer['name']}: no readable {MANIFEST}"]
            if not problems:
                yield info
            else:
                log.warning(
                    "latest names %s, which does not verify (%s); using the newest good one",
                    pointer["name"],
                    "; ".join(problems),
                )
        for info in reversed(self.list()):
            if info.name in tried:
                continue
            problems = self.check(info, deep)
            if problems:
                log.warning("skipping checkpoint %s: %s", info.name, "; ".join(problems))
                continue
            yield info

    def claim_generation(self, label: str = "") -> int:
        """Claims a writer generation higher than any claimed before, with an exclusive create.

        Each run of the flow (a restart too) claims one. Commits refuse to go on once a higher
        generation has been claimed, so of two processes advancing one run, the older one stops."""
        generation = max(self._newest_claim(), (self.read_pointer() or {}).get("generation", 0)) + 1
        for _ in range(100):
            body = json.dumps({"generation": generation, "label": label, **Writer.current().__dict__}).encode()
            if self.storage.create(f"{CLAIMS}/{generation:012d}", body):
                return generation
            generation += 1
        raise FencedError(f"{self.uri}: could not claim a writer generation (100 concurrent claims?)")

    def _newest_claim(self) -> int:
        names = self.storage.sizes(CLAIMS) if self.storage.exists(CLAIMS) else {}
        return max((int(n) for n in names if n.isdigit()), default=0)

    def _check_fence(self, writer: Writer) -> None:
        newest = max(self._newest_claim(), (self.read_pointer() or {}).get("generation", 0))
        if newest > writer.generation:
            raise FencedError(
                f"{self.uri}: writer generation {newest} has claimed this run; this writer "
                f"(generation {writer.generation}) is stale and stops without writing"
            )


def _score(info: CheckpointInfo, attribute: str, order: str) -> tuple[int, float]:
    """Sort key, best first."""
    value = info.manifest.metadata.get("metrics", {}).get(attribute)
    if value is None:
        return (1, 0.0)
    return (0, -float(value) if order == "max" else float(value))


_HASHER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-hash")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def serialize(objects: dict[str, Any]) -> dict[str, bytes]:
    import torch  # here, not at the top: listing and verifying checkpoints needs no torch (~1.4 s to import)

    blobs = {}
    for fname, obj in objects.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        blobs[fname] = buf.getvalue()
    return blobs


def safe_load(data: bytes, where: str) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers only, never code."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where} holds objects that only an unsafe unpickler could load; refusing it "
            f"(weights_only=True). If you wrote this file yourself, re-save it with tensors and plain "
            f"containers only. Detail: {str(exc).splitlines()[0]}"
        ) from exc


def open_checkpoint_uri(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    option: str = "load_path",
) -> LoadedCheckpoint:
    """Loads a checkpoint named by URI: a checkpoint folder, or a run folder (its latest good one)."""
    uri = str(uri).rstrip("/").removesuffix(f"/{MANIFEST}").rstrip("/")
    probe = Storage(uri, storage_options)
    if probe.exists(MANIFEST) and f"/{CHECKPOINTS}/" in uri:
        run_uri, name = uri.rsplit(f"/{CHECKPOINTS}/", 1)
        folder, run = run_uri.rsplit("/", 1)
        return CheckpointStore(folder, run, storage_options=storage_options).load(name, files)
    if "/" in uri and (probe.exists(POINTER) or probe.exists(CHECKPOINTS)):
        folder, run = uri.rsplit("/", 1)
        loaded = CheckpointStore(folder, run, storage_options=storage_options).load_latest(files)
        if loaded is not None:
            return loaded
        raise NotACheckpointError(f"{option}={uri!r}: the run there has no checkpoint that verifies")
    raise NotACheckpointError(
        f"{option}={uri!r}: neither a checkpoint folder (with {MANIFEST}) nor a run folder "
        f"(with '{POINTER}' or '{CHECKPOINTS}/'); point it at <save_folder>/<run_name> or "
        f"<save_folder>/<run_name>/{CHECKPOINTS}/<name>"
    )
