"""A deployment run's local files, opened under the worker's allowed roots at the moment of use, never through a link.

training/config/trust.py checks the locations a run's parameters name (``save_folder``, ``load_path``,
``export_on_complete``) once, before anything is written. A check by path proves nothing about a later use by path:
an export folder or a save folder replaced by a link after the start sent the export and further checkpoints outside
every root, and a link inside an allowed Hugging Face folder (or the file a Composer ``.symlink`` names) read another
team's weights. So while a run with untrusted parameters is open in this process (``enter``), every local file the
store, the ``load_path`` readers and the export touch is reached from its allowed root one component at a time with
``openat`` and ``O_NOFOLLOW``: a link anywhere below the root is LinkedLocationError (permanent, one line), whatever
it points at. The roots themselves, and links above them, are the worker operator's choice. Object stores have no
links: nothing changes for their files, but the roots in force list the worker's object-store roots too (``remote_roots``),
so a product reader that opens a URL a run named (training/data/) refuses one outside them before any request. Rank
processes inherit all the roots through ``ROOTS_ENV`` (set by training/distributed/gang.py);
``python -m flows.train`` and ``train()`` from Python never enter this mode.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator

from checkpointing.errors import LinkedLocationError
from checkpointing.io.localfs import LocalFiles

ROOTS_ENV = (
    "TRAIN_CONFINED_ROOTS"  # JSON list of the roots (local paths, protocol://bucket/path), for a run's processes
)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_state: list[list[str]] = []  # the roots in force (innermost last); a global: the committer's threads write too


def enter(roots: list[str]) -> None:
    """From now on locations must lie under ``roots``: absolute local paths, and ``protocol://bucket/path`` object-store
    roots already normalized (training/config/trust.py); empty: no location at all."""
    _state.append([_root(r) for r in roots])


def leave() -> None:
    if _state:
        _state.pop()


@contextlib.contextmanager
def confined(roots: list[str]) -> Iterator[None]:
    enter(roots)
    try:
        yield
    finally:
        leave()


def roots() -> list[str] | None:
    """Every root in force (local and object-store), or None when this process runs no confined run."""
    if _state:
        return _state[-1]
    raw = os.environ.get(ROOTS_ENV)
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        found = []  # unreadable: confined to nothing rather than free
    return [_root(r) for r in found if isinstance(r, str)] if isinstance(found, list) else []


def local_roots() -> list[str] | None:
    """The local roots in force, or None when this process runs no confined run."""
    every = roots()
    return None if every is None else [r for r in every if not _is_remote(r)]


def remote_roots() -> list[str] | None:
    """The object-store roots in force (``protocol://bucket/path``), or None when this process runs no confined run."""
    every = roots()
    return None if every is None else [r for r in every if _is_remote(r)]


def _is_remote(root: str) -> bool:
    return "://" in root


def _root(root: str) -> str:
    return root if _is_remote(root) else os.path.abspath(root)


def root_of(path: str, where: str) -> tuple[str, list[str]]:
    """The allowed root that holds ``path`` (compared as written: links are not resolved) and the components below
    it; LinkedLocationError when no root does."""
    roots = local_roots() or []
    here = os.path.abspath(os.path.expanduser(path))
    for root in sorted(roots, key=len, reverse=True):
        if here == root or here.startswith(root.rstrip("/") + "/"):
            return root, [p for p in here[len(root) :].split("/") if p]
    raise LinkedLocationError(
        f"{where}: outside the local roots this worker allows ({', '.join(roots) or 'none'}); use a location under "
        f"one of them (TRAIN_ALLOWED_ROOTS)"
    )


def local_files(folder: str, where: str) -> LocalFiles:
    """LocalFiles for ``folder``, anchored at its allowed root: every folder between them must be real."""
    root, parts = root_of(folder, where)
    return LocalFiles(root, "/".join(parts), confined=True)


@contextlib.contextmanager
def _walk(path: str, where: str) -> Iterator[tuple[int, str]]:
    """The descriptor of the folder holding ``path`` and the last component's name ('' for a root itself), reached
    from the root without following a link."""
    root, parts = root_of(path, where)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            child = _open_folder(fd, part, where)
            os.close(fd)
            fd = child
        yield fd, parts[-1] if parts else ""
    finally:
        os.close(fd)


def _open_folder(fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
            raise _linked(where) from exc
        raise


def open_file(path: str, flags: int, where: str) -> int:
    """``os.open(path, flags)`` reached from its allowed root, a link at any level refused."""
    with _walk(path, where) as (folder, name):
        if not name:
            return os.open(".", flags | os.O_CLOEXEC, dir_fd=folder)
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(folder, name)):
                raise _linked(where) from exc
            raise


def kind(path: str, where: str) -> str | None:
    """'dir', 'file', 'other' (a FIFO, a device...) or None when nothing is there; a link is LinkedLocationError."""
    try:
        with _walk(path, where) as (folder, name):
            mode = os.stat(name or ".", dir_fd=folder, follow_symlinks=False).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(mode):
        raise _linked(where)
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def names(path: str, where: str) -> set[str] | None:
    """The names in folder ``path``, or None when it is not a folder."""
    try:
        fd = open_file(path, os.O_RDONLY | os.O_DIRECTORY, where)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return set(os.listdir(fd))
    finally:
        os.close(fd)


def check(path: str, where: str) -> None:
    """LinkedLocationError unless ``path`` lies under an allowed root with no link on the way (it may not exist)."""
    kind(path, where)


def _linked(where: str) -> LinkedLocationError:
    return LinkedLocationError(
        f"{where}: a symbolic link below the allowed root (TRAIN_ALLOWED_ROOTS); a deployment run never reads or "
        f"writes through links there: name the real file or folder"
    )


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
