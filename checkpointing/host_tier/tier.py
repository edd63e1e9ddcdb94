"""The host-memory tier: a run's newest snapshots in this machine's shared memory, so that a relaunch on the same
machine after a hard kill (SIGKILL, the OOM killer, a segfault) resumes from where training stood one step ago.

Layout: ``<root>/resumable-train-<uid>/<run key>/r<rank>-s<slot>.{data,tree,json}`` where ``root`` is ``/dev/shm``
(``TRAIN_HOST_TIER_DIR`` in the worker's environment chooses another: a parameter never does) and the run key is a
hash of the store's URI, so two runs never share a folder. The user's folder must be a real folder of this user
that nobody else can open (0700, checked with lstat and opened without following links; every file below it is
opened relative to it with ``O_NOFOLLOW``), so another user can neither plant nor read a snapshot: a folder that
fails the check turns the tier off for the run, with one warning.

A slot is three files: ``.data`` (every tensor's bytes at a fixed offset: the snapshot buffers themselves, mapped
into the training process, reserved with ``posix_fallocate`` so a full ``/dev/shm`` fails at allocation instead of
killing the process with SIGBUS on a page fault), ``.tree`` (the state's structure with each tensor replaced by its
index, ``torch.save``d) and ``.json`` (the record: progress, metadata, tensor table, checksums). The record is
written last and removed first: a slot whose record exists holds the whole snapshot it describes. Checksums are
xxHash3-128 (13-14 GB/s on one core here, against 1.5 GB/s for sha256): they guard against a torn or damaged slot,
not against an attacker, whom the folder's permissions keep out. Reading copies the bytes out of the slot and
verifies the copy, so what is loaded is what was verified.

Nothing here knows about training: ``checkpointing/commit/snapshots.py`` fills slots and decides which to keep.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import xxhash

from checkpointing.errors import CheckpointError, TierUnavailable
from checkpointing.host_tier.cap import allocation_lock, check_room
from checkpointing.serialization import safe_load

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
ROOT_ENV = "TRAIN_HOST_TIER_DIR"
FORMAT = 2  # 2: the record carries a checksum of its own fields (record_xxh)
MAX_RECORD_BYTES = 64 << 20
MAX_TREE_BYTES = 256 << 20
MAX_SLOTS = 3
TENSOR_MARK = "__host_tensor__"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ALIGN = 4096
STALE_SECONDS = 24 * 3600  # another run's folder untouched this long, and held by no live process, is removed
_RUN_KEY = re.compile(r"[0-9a-f]{32}")

# dtype names a record may name: the ones a state dict holds (anything else in a record is damage)
DTYPES = {
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
}


def checksum(view: memoryview | bytes | bytearray) -> str:
    return xxhash.xxh3_128_hexdigest(view)


def run_key(store_uri: str) -> str:
    return sha256(store_uri.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class TensorEntry:
    offset: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Record:
    """What a published slot holds (its ``.json``): enough to resume from it without the store."""

    name: str  # the checkpoint name the store gives (or will give) this state
    progress: dict[str, int]
    metadata: dict[str, Any]
    generation: int
    seq: int  # order of publication within this run on this machine
    tensors: list[TensorEntry]
    data_bytes: int
    data_xxh: str
    tree_xxh: str
    store_uri: str
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        body = {
            **self.__dict__,
            "format": FORMAT,
            "tensors": [[t.offset, t.dtype, list(t.shape)] for t in self.tensors],
        }
        fields = json.loads(json.dumps(body, allow_nan=False))  # as a reader will parse it (tuples, int keys)
        return json.dumps({**fields, "record_xxh": _fields_checksum(fields)}, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, store_uri: str) -> Record:
        """The record, or ValueError: its checksum must match its fields (progress, generation, the claim: all of
        them), and every field is typed and bounded (a slot is read as untrusted bytes)."""
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("store_uri") != store_uri:
            raise ValueError("not a record of this run's format")
        if raw.pop("record_xxh", None) != _fields_checksum(raw):
            raise ValueError("its fields do not match the record's checksum")
        progress, metadata = raw.get("progress"), raw.get("metadata")
        if not isinstance(progress, dict) or not all(_is_count(v) for v in progress.values()):
            raise ValueError("progress is not a table of counts")
        if not isinstance(metadata, dict):
            raise ValueError("metadata is not a table")
        ints = [raw.get(k) for k in ("generation", "seq", "data_bytes")]
        if not all(_is_count(v) for v in ints):
            raise ValueError("generation, seq or data_bytes is not a count")
        strings = [raw.get(k) for k in ("name", "data_xxh", "tree_xxh")]
        if not all(isinstance(s, str) and 0 < len(s) <= 256 for s in strings):
            raise ValueError("name or a checksum is not a short string")
        tensors = [_tensor_entry(t) for t in _list(raw.get("tensors"))]
        end = max((t.offset + t.nbytes for t in tensors), default=0)
        if end > raw["data_bytes"]:
            raise ValueError("a tensor lies past the slot's data")
        created = raw.get("created_at")
        return cls(
            raw["name"],
            progress,
            metadata,
            raw["generation"],
            raw["seq"],
            tensors,
            raw["data_bytes"],
            raw["data_xxh"],
            raw["tree_xxh"],
            store_uri,
            float(created) if isinstance(created, int | float) else 0.0,
        )


def _fields_checksum(fields: dict[str, Any]) -> str:
    """xxHash3 of a record's fields in one canonical form (sorted keys, no spaces): a bit set in any of them shows."""
    return checksum(json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) > 1 << 20:
        raise ValueError("the tensor table is not a list")
    return value


def _tensor_entry(raw: Any) -> TensorEntry:
    import torch

    if not (isinstance(raw, list) and len(raw) == 3 and _is_count(raw[0]) and raw[1] in DTYPES):
        raise ValueError("a tensor entry is damaged")
    shape = raw[2]
    if not isinstance(shape, list) or len(shape) > 64 or not all(_is_count(n) for n in shape):
        raise ValueError("a tensor's shape is damaged")
    count = 1
    for n in shape:
        count *= n
    nbytes = count * getattr(torch, raw[1]).itemsize
    if nbytes >= 1 << 46:
        raise ValueError("a tensor is too big")
    return TensorEntry(raw[0], raw[1], tuple(shape), nbytes)


def layout(nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets (page-aligned, so device copies start aligned) for tensors of these sizes, and the bytes they take."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end += -(-max(n, 1) // _ALIGN) * _ALIGN
    return offsets, end


class Slot:
    """Reused snapshot buffers: a mapping of ``size`` bytes, shared (a ``.data`` file of the tier) or private."""

    def __init__(self, index: int, size: int, buffer: mmap.mmap, shared: bool, filesystem: str = ""):
        self.index, self.size, self.buffer, self.shared = index, size, buffer, shared
        self.filesystem = filesystem  # of a shared slot's file ("" for private memory)
        self.registered_ptr: int | None = None  # set when pinned for CUDA (checkpointing/commit/snapshots.py)

    @property
    def pinnable(self) -> bool:
        """Whether CUDA can page-lock it: private memory, or a file in memory (tmpfs, hugetlbfs). The kernel refuses
        to pin the page cache of a file on disk for long (cudaHostRegister then fails with 'invalid argument')."""
        return not self.shared or self.filesystem in ("tmpfs", "hugetlbfs")

    def tensor(self, entry: TensorEntry) -> Any:
        """A tensor over the slot's bytes at ``entry`` (its own storage, so ``torch.save`` writes only its bytes)."""
        import torch

        dtype = getattr(torch, entry.dtype)
        count = entry.nbytes // dtype.itemsize
        flat = torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=entry.offset) if count else None
        return flat.view(entry.shape) if flat is not None else torch.empty(entry.shape, dtype=dtype)

    @classmethod
    def private(cls, index: int, size: int) -> Slot:
        return cls(index, size, mmap.mmap(-1, max(size, 1)), shared=False)


class HostTier:
    """One run's slots on this machine, for one rank. Raises TierUnavailable when the folder cannot be trusted or
    made."""

    def __init__(self, store_uri: str, rank: int = 0, root: str | None = None):
        self.store_uri, self.rank = store_uri, rank
        self.root = root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT
        self.key = run_key(store_uri)
        user_dir = os.path.join(self.root, f"resumable-train-{os.getuid()}")
        self.path = os.path.join(user_dir, self.key)
        # A shared lock, held while this process uses the folder (the kernel drops it when the process dies): another
        # process's sweep of abandoned folders (_sweep_stale) never removes one that a live process holds. Taken after
        # a sweep that was removing this very folder has finished: then the folder is made again.
        self._user_fd = -1
        for _ in range(3):
            self._fd = self._open_private(user_dir, self.key)
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_SH)
            if os.fstat(self._fd).st_nlink:
                break
            os.close(self._fd)
        self.filesystem = filesystem_type(self.path)

    # -- the folder ---------------------------------------------------------------------------------
    def _open_private(self, user_dir: str, key: str) -> int:
        root_fd = _open_root(self.root)
        try:
            user_fd = private_dir(root_fd, os.path.basename(user_dir), user_dir)
        finally:
            os.close(root_fd)
        try:
            _sweep_stale(user_fd, keep=key)
            fd = private_dir(user_fd, key, self.path)
        except BaseException:
            os.close(user_fd)
            raise
        if self._user_fd >= 0:
            os.close(self._user_fd)
        self._user_fd = user_fd  # kept: the cap is measured (and the allocation lock taken) on it
        return fd

    def close(self) -> None:
        for fd in (self._fd, self._user_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd = self._user_fd = -1

    def remove(self) -> None:
        """Deletes every file of the run's folder (all ranks'), then the folder: the run completed."""
        with contextlib.suppress(OSError):
            for entry in os.listdir(self._fd):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=self._fd)
            os.rmdir(self.path)
        self.close()

    def _file(self, slot: int, ext: str, rank: int | None = None) -> str:
        return f"r{self.rank if rank is None else rank}-s{slot}.{ext}"

    # -- writing ------------------------------------------------------------------------------------
    def allocate(self, index: int, size: int) -> Slot:
        """A shared slot of at least ``size`` bytes, its record removed (it no longer holds a snapshot)."""
        self.invalidate(index)
        name = self._file(index, "data")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)
        with allocation_lock(self._user_fd):
            check_room(self._user_fd, max(size, 1), self.path)  # TierFull past TRAIN_HOST_TIER_MAX_BYTES
            fd = os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd
            )
            try:
                os.posix_fallocate(fd, 0, max(size, 1))  # reserved now: a full /dev/shm fails here, not as SIGBUS
                return Slot(index, size, mmap.mmap(fd, max(size, 1)), shared=True, filesystem=self.filesystem)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._fd)
                why = "not enough shared memory" if exc.errno in (errno.ENOSPC, errno.ENOMEM) else exc.strerror
                raise TierUnavailable(f"{self.path}: {size / 1e6:.0f} MB cannot be reserved ({why})") from exc
            finally:
                os.close(fd)

    def invalidate(self, index: int) -> None:
        """The slot no longer holds a snapshot: its record goes first, before any of its bytes change."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(index, "json"), dir_fd=self._fd)

    def publish(self, slot: Slot, record: Record, tree: bytes) -> None:
        """Makes ``slot`` a snapshot: its tree, then its record (written whole and renamed into place). They count
        against the per-user cap as its buffer does, checked under the same lock: TierFull, and nothing written, when
        they would take this user past it (a buffer's check alone let 20 runs killed at once end 8-20 KB past it)."""
        data = record.to_json()
        names = (self._file(slot.index, "tree"), self._file(slot.index, "json"))
        with allocation_lock(self._user_fd):
            check_room(self._user_fd, self._growth(names, (len(tree), len(data))), self.path, "snapshot record")
            self._write(names[0], tree)
            self._write(names[1], data)

    def _growth(self, names: tuple[str, ...], sizes: tuple[int, ...]) -> int:
        """What the cap will count more once the files ``names`` hold ``sizes`` bytes (whole blocks, as the cap
        counts a file as allocated) than it counts for them now."""
        block = os.fstatvfs(self._fd).f_bsize or 4096
        new = sum(-(-size // block) * block for size in sizes)
        old = 0
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
                old += max(st.st_size, st.st_blocks * 512)
        return max(new - old, 0)

    def _write(self, name: str, data: bytes) -> None:
        tmp = f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)

    # -- reading ------------------------------------------------------------------------------------
    def records(self, rank: int | None = None) -> Iterator[tuple[int, Record]]:
        """(slot, record) of each slot of ``rank`` whose record parses; nothing is verified beyond that."""
        for index in range(MAX_SLOTS):
            data = self._read(self._file(index, "json", rank), MAX_RECORD_BYTES)
            if data is None:
                continue
            try:
                yield index, Record.from_json(data, self.store_uri)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("host-memory tier: slot %d of rank %d is damaged (%s); not used", index, rank, exc)

    def load(self, index: int, record: Record, rank: int | None = None) -> dict[str, Any] | None:
        """The snapshot in ``index`` as objects (private copies), or None when it does not verify."""
        buffer = bytearray(record.data_bytes)
        tree = self._read(self._file(index, "tree", rank), MAX_TREE_BYTES)
        if tree is None or not self._read_into(self._file(index, "data", rank), buffer):
            return None
        if checksum(buffer) != record.data_xxh or checksum(tree) != record.tree_xxh:
            log.warning("host-memory tier: snapshot %s does not match its checksums; not used", record.name)
            return None
        copy = Slot(index, len(buffer), buffer, shared=False)  # type: ignore[arg-type]
        try:
            tensors = [copy.tensor(e) for e in record.tensors]
            return rebuild(safe_load(tree, f"host-memory snapshot {record.name}"), tensors)
        except (CheckpointError, ValueError, TypeError, IndexError, RecursionError) as exc:
            log.warning("host-memory tier: snapshot %s is damaged (%s); not used", record.name, type(exc).__name__)
            return None

    def _read(self, name: str, limit: int) -> bytes | None:
        """A small regular file of this user's (at most ``limit`` bytes), read whole, or None."""
        with self._open_file(name) as f:
            if f is None or os.fstat(f.fileno()).st_size > limit:
                return None
            return f.read(limit)

    def _read_into(self, name: str, buffer: bytearray) -> bool:
        """Fills ``buffer`` from the start of a regular file of this user's; False if it is shorter or not one."""
        with self._open_file(name) as f:
            if f is None:
                return False
            view, done = memoryview(buffer), 0
            while done < len(buffer):  # one read() returns at most ~2 GB
                n = f.readinto(view[done:])
                if not n:
                    return False
                done += n
            return True

    @contextlib.contextmanager
    def _open_file(self, name: str) -> Iterator[Any]:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self._fd)
        except OSError:
            yield None
            return
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
            os.close(fd)
            log.warning("host-memory tier: %s is not a file of this run; not read", name)
            yield None
            return
        with os.fdopen(fd, "rb", buffering=0) as f:
            yield f


def verified(tier: HostTier, index: int, record: Record, rank: int) -> dict[str, Any] | None:
    """The snapshot's objects when they verify and the position in its tree is the one its record gives (the record
    chooses the slot and says how far along it is: both must be the snapshot's own); None otherwise. What a relaunch
    here resumes from, and what the persisting agent commits (checkpointing/commit/agent.py)."""
    objects = tier.load(index, record, rank)
    if objects is None:
        return None
    trees = [v["progress"] for v in objects.values() if isinstance(v, dict) and isinstance(v.get("progress"), dict)]
    if not trees or any({k: tree.get(k) for k in record.progress} != record.progress for tree in trees):
        log.warning(
            "host-memory tier: slot %d of rank %d (%s) records a position its snapshot does not hold; not used",
            index,
            rank,
            record.name,
        )
        return None
    return objects


def _open_root(root: str) -> int:
    """The tier's root folder, opened; one named by TRAIN_HOST_TIER_DIR that does not exist yet is made (0700)."""
    try:
        return os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        if root == DEFAULT_ROOT:
            raise TierUnavailable(f"{root} does not exist on this machine") from None
    except OSError as exc:
        raise TierUnavailable(f"{root} cannot be opened ({exc.strerror})") from exc
    try:
        os.makedirs(root, 0o700, exist_ok=True)
        log.info("host-memory tier: made %s (mode 0700) as %s names it", root, ROOT_ENV)
        return os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise TierUnavailable(f"{root} ({ROOT_ENV}) cannot be made or opened ({exc.strerror})") from exc


def filesystem_type(path: str) -> str:
    """The type of the file system ``path`` is on ("tmpfs", "ext4", ...), from /proc/self/mounts; "" if unknown."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].encode().decode("unicode_escape")  # spaces are written \040
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


def _sweep_stale(user_fd: int, keep: str) -> None:
    """Removes other runs' folders that no live process holds and that are empty or nothing wrote to for ``STALE_SECONDS``: runs
    that were abandoned (never completed, never relaunched here) would otherwise keep their snapshots in this
    machine's memory for good. Only names of the run-key shape are touched; a link or a stranger's entry is left."""
    now = time.time()
    try:
        names = [n for n in os.listdir(user_fd) if n != keep and _RUN_KEY.fullmatch(n)]
    except OSError:
        return
    for name in names:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=user_fd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a live process holds the folder
            entries = os.listdir(fd)
            newest = max(
                [os.fstat(fd).st_mtime] + [os.stat(e, dir_fd=fd, follow_symlinks=False).st_mtime for e in entries]
            )
            if entries and now - newest < STALE_SECONDS:  # an empty folder holds nothing to resume: gone at once
                continue
            for entry in entries:
                os.unlink(entry, dir_fd=fd)
            os.rmdir(name, dir_fd=user_fd)
            log.info(
                "removed an abandoned run's snapshots from host memory (untouched for %.0f h)", (now - newest) / 3600
            )
        except OSError:
            continue
        finally:
            os.close(fd)


def private_dir(parent_fd: int, name: str, shown: str, setting: str = ROOT_ENV) -> int:
    """Opens (making it if missing) folder ``name`` below ``parent_fd``: a folder (not a link) of this user's that
    nobody else may enter, or TierUnavailable."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise TierUnavailable(f"{shown} is not a folder that can be opened without following a link") from exc
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise TierUnavailable(
            f"{shown} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, not to this user (uid "
            f"{os.getuid()}) alone; remove it, or set {setting} to a folder of your own"
        )
    return fd


def rebuild(node: Any, tensors: list[Any]) -> Any:
    """The tree with each ``{TENSOR_MARK: i}`` replaced by tensor ``i``."""
    if isinstance(node, dict):
        if len(node) == 1 and TENSOR_MARK in node:
            index = node[TENSOR_MARK]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise IndexError("a tensor index is out of range")
            return tensors[index]
        return {k: rebuild(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [rebuild(v, tensors) for v in node]
    if isinstance(node, tuple):
        return tuple(rebuild(v, tensors) for v in node)
    return node
