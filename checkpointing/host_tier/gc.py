"""Which of this user's host-memory tier folders are abandoned, and removing them: when a pipeline opens (the ones a
relaunch would never resume from) and on request (``python -m checkpointing gc``: every one no live process holds).

A run that is killed and never relaunched keeps its snapshots in ``/dev/shm`` (RAM) until something removes them.
A folder is *live* while a process has it open: every ``HostTier`` holds a shared ``flock`` on its run folder for as
long as it is open, and the kernel drops it when the process dies, SIGKILL included. Removing a folder takes the
exclusive lock without waiting, so a live run's folder is never touched (it is reported as live and left alone).

Why a folder no live process holds is abandoned (``Folder.why``):

- it holds no record that verifies (the run died before its first snapshot, or the record is damaged);
- its store moved past it: the same rule a relaunch applies (``not_resumable``): the store's newest checkpoint is as
  far along, a newer writer committed, a roll-back was made after it, or the writer's claim is no longer in the store;
- its store is gone (a local run folder that no longer exists);
- nothing wrote to it for ``STALE_SECONDS``.

Only a local store (an absolute path) is looked at: a store URI read from ``/dev/shm`` is never used to send a request
anywhere. A folder of another run that none of these fits (killed recently, its store elsewhere) is ``resumable``:
the sweep at a pipeline's opening keeps it (a relaunch here would resume from it); ``gc --delete`` removes it. Nothing
here follows a link or adopts a folder another user owns, or one others may enter.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from checkpointing.errors import TierUnavailable
from checkpointing.host_tier.cap import folder_bytes
from checkpointing.host_tier.tier import (
    _DIR_FLAGS,
    _RUN_KEY,
    DEFAULT_ROOT,
    MAX_RECORD_BYTES,
    ROOT_ENV,
    STALE_SECONDS,
    HostTier,
    Record,
    private_dir,
    run_key,
)
from checkpointing.io.untrusted import printable
from checkpointing.store import CheckpointInfo, CheckpointStore

log = logging.getLogger(__name__)

RESUMABLE = "resumable"  # Folder.why of a folder a relaunch on this machine would resume from
_RECORD_NAME = re.compile(r"r\d{1,6}-s\d\.json")


def claim_of(store: CheckpointStore, generation: int) -> dict[str, Any]:
    """What the store's claim of ``generation`` says of who made it (what a snapshot records, and is matched on)."""
    claim = store.fence.read(generation)
    return {"claimed_at": claim.claimed_at, "host": claim.host, "pid": claim.pid}


def not_resumable(store: CheckpointStore, record: Record, latest: CheckpointInfo | None) -> str:
    """Why the store has moved past the snapshot ``record`` describes ("" if it has not)."""
    if latest is not None and position(record.progress) <= position(latest.progress):
        return f"the store's {latest.name} is as far along"
    if latest is not None and latest.manifest.writer.generation > record.generation:
        return f"a newer writer (generation {latest.manifest.writer.generation}) committed {latest.name}"
    if any(rb.get("generation", 0) > record.generation for rb in store.rollbacks()):
        return "the run was rolled back after it was taken"
    if record.metadata.get("claim") != claim_of(store, record.generation):
        return f"the store no longer holds the claim of writer generation {record.generation} it was taken under"
    return ""


def position(progress: dict[str, int]) -> tuple[int, int]:
    """How far along: samples seen, then steps (a loop of its own may count reports only)."""
    return progress.get("samples_seen", 0), progress.get("step", 0)


@dataclass
class Folder:
    key: str  # the folder's name (a hash of the store's URI)
    store_uri: str  # from its newest record that verifies ("" when none does)
    nbytes: int
    age_seconds: float  # since anything in it was last written
    live: bool
    why: str = ""  # why it is abandoned, or RESUMABLE; "" for a live one


def sweep(root: str | None, decide: Callable[[Folder], bool], keep: str = "") -> list[Folder]:
    """Every run folder of this user's under the tier's ``root``, each classified while its exclusive lock is held
    and removed when ``decide`` says so (never a live one: its lock cannot be taken)."""
    user_fd = _user_folder(root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT)
    if user_fd is None:
        return []
    found = []
    try:
        for name, fd in _run_folders(user_fd, keep):
            try:
                folder = _classify(name, fd)
                if not folder.live and decide(folder):
                    _empty(fd)
                    os.rmdir(name, dir_fd=user_fd)
                found.append(folder)
            except OSError as exc:
                log.warning("host-memory tier: folder %s left as it is (%s)", name, exc.strerror)
            finally:
                os.close(fd)
    finally:
        os.close(user_fd)
    return found


def sweep_on_open(tier: HostTier) -> None:
    """A pipeline opens: other runs' folders that a relaunch would never resume from are removed (see above)."""
    for folder in sweep(tier.root, lambda f: f.why != RESUMABLE, keep=tier.key):
        if not folder.live and folder.why != RESUMABLE:
            log.info(
                "host-memory tier: removed an abandoned run's snapshots (%.1f MB): %s", folder.nbytes / 1e6, folder.why
            )


def _user_folder(root: str) -> int | None:
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return None
    name = f"resumable-train-{os.getuid()}"
    try:
        os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except OSError:
        os.close(root_fd)
        return None  # none yet: nothing to sweep (and nothing is made)
    try:
        return private_dir(root_fd, name, os.path.join(root, name))
    finally:
        os.close(root_fd)


def _run_folders(user_fd: int, keep: str) -> Iterator[tuple[str, int]]:
    for name in sorted(os.listdir(user_fd)):
        if name == keep or not _RUN_KEY.fullmatch(name):
            continue
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=user_fd)  # a link is refused here (O_NOFOLLOW)
        except OSError:
            continue
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            os.close(fd)
            log.warning("host-memory tier: %s is not a private folder of this user's; left alone", name)
            continue
        yield name, fd


def _classify(name: str, fd: int) -> Folder:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a live process holds the folder
        live = False
    except BlockingIOError:
        live = True
    entries = os.listdir(fd)
    stamps = [os.fstat(fd).st_mtime] + [os.stat(e, dir_fd=fd, follow_symlinks=False).st_mtime for e in entries]
    folder = Folder(name, "", folder_bytes(fd), max(0.0, time.time() - max(stamps)), live)
    if live:
        return folder
    record = _newest_record(name, fd, entries)
    folder.store_uri = record.store_uri if record else ""
    if record is None:
        folder.why = "it holds no snapshot that verifies"
    elif moved := _store_moved_past(record):
        folder.why = moved
    elif folder.age_seconds > STALE_SECONDS:
        folder.why = f"nothing wrote to it for {folder.age_seconds / 3600:.0f} h"
    else:
        folder.why = RESUMABLE
    return folder


def _newest_record(key: str, fd: int, entries: list[str]) -> Record | None:
    records = []
    for entry in entries:
        if not _RECORD_NAME.fullmatch(entry):
            continue
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
            data = _read_small(fd, entry)
            uri = json.loads(data).get("store_uri")
            if isinstance(uri, str) and run_key(uri) == key:
                records.append(Record.from_json(data, uri))
    return max(records, key=lambda r: r.seq, default=None)


def _read_small(fd: int, entry: str) -> bytes:
    file_fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    with os.fdopen(file_fd, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_size > MAX_RECORD_BYTES or not stat.S_ISREG(st.st_mode):
            raise ValueError("not a record file of this user's")
        return f.read(MAX_RECORD_BYTES)


def _store_moved_past(record: Record) -> str:
    """Why a local store no longer wants this snapshot ("" if it may, or if the store is not a local folder)."""
    path = record.store_uri.removeprefix("file://")
    if not path.startswith("/") or "://" in path:
        return ""
    if not os.path.isdir(path):
        return f"its store {printable(record.store_uri)} is gone"
    folder, _, run = path.rpartition("/")
    try:
        store = CheckpointStore(folder or "/", run)
        return not_resumable(store, record, store.latest())
    except Exception as exc:  # a store that cannot be read says nothing either way
        log.debug("host-memory tier: store %s not read: %s", printable(record.store_uri), exc)
        return ""


def _empty(fd: int) -> None:
    for entry in os.listdir(fd):
        os.unlink(entry, dir_fd=fd)


# -- python -m checkpointing gc ---------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    gc = sub.add_parser(
        "gc",
        help="list this user's abandoned host-memory snapshots (/dev/shm); --delete removes them (never a live run's)",
    )
    gc.add_argument("--delete", action="store_true", help="remove the abandoned snapshots listed (default: list only)")
    gc.add_argument("--dir", help=f"the tier's folder (default: {ROOT_ENV}, else {DEFAULT_ROOT})")


def cmd_gc(args: argparse.Namespace, options: dict[str, Any]) -> int:
    try:
        folders = sweep(args.dir, lambda f: bool(args.delete))
    except TierUnavailable as exc:
        print(f"error: {exc}")
        return 1
    abandoned = [f for f in folders if not f.live]
    rows = [("run", "size MB", "age h", "why abandoned")]
    for f in abandoned:
        why = (
            "killed or failed, never relaunched here (a relaunch would resume from it)" if f.why == RESUMABLE else f.why
        )
        rows.append((printable(f.store_uri) or f.key, f"{f.nbytes / 1e6:.1f}", f"{f.age_seconds / 3600:.1f}", why))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(row)))
    total = sum(f.nbytes for f in abandoned) / 1e6
    verb = "removed" if args.delete else "abandoned (remove them with --delete)"
    print(f"{len(abandoned)} folder(s), {total:.1f} MB {verb}; {len(folders) - len(abandoned)} live run(s) left alone")
    return 0
