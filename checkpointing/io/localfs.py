"""Local-folder I/O that never follows a symbolic link below the folder it was given.

A run folder may hold damage or a trap: ``state.pt`` replaced by a link to a file outside the run, to
``/dev/zero`` or to a FIFO. fsspec's local filesystem (like ``open``) follows links, so a reader could
hang or read outside the run, and a writer could overwrite a file elsewhere through the link. Here
every path is walked one component at a time from an anchor folder with ``O_NOFOLLOW`` and directory
file descriptors (``openat``), so nothing can be swapped in between the check and the use:

- reading: a link, or anything but a regular file, is reported as damage (a warning) and reads as
  missing: the checkpoint that holds it fails verification and the reader falls back;
- writing: a link where a file or folder of the run is to be written is removed (never followed) and
  replaced; a run folder that is itself a link is refused (point ``save_folder`` at the real place). A
  whole-file write goes to a temporary file in the same folder and is renamed over the name (a rename
  replaces a link there, never follows it), so a kill mid-write leaves the old file, never an empty one;
  small files (``latest``, manifests, records) are also fsync'ed first, big ones are vouched for by the
  manifest instead (an fsync costs ~1 s per 200 MB here);
- walking: folders are walked without recursion and at most MAX_TREE_DEPTH deep; a deeper tree is damage,
  reported as TOO_DEEP (1500 nested folders failed every relaunch with RecursionError).

Links at or above the anchor (``save_folder`` itself on another disk, say) are the user's own choice, except for a
run whose locations are confined to the worker's allowed roots (checkpointing/io/confine.py): there the anchor is the
root, and a link anywhere between it and the run folder is LinkedLocationError, for reads and writes alike.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from typing import IO, Any

from checkpointing.errors import LinkedLocationError, UnsafePathError
from checkpointing.io.untrusted import printable

log = logging.getLogger(__name__)

NOT_A_FILE = -1  # the size ``sizes`` reports for a link, FIFO or device found where files belong
TOO_DEEP = -2  # the size ``sizes`` reports for a folder at MAX_TREE_DEPTH, whose content is not walked
# What the store lays out is at most 2 levels below a listed prefix (checkpoints are flat folders of files);
# 16 leaves room for people's own folders and keeps a walk's open descriptors few.
MAX_TREE_DEPTH = 16
FSYNC_UP_TO = 16 << 20  # untrusted.MAX_MANIFEST_BYTES: every small file the store writes is fsync'ed
_CHUNK = 16 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class LocalFiles:
    """Files under ``anchor/base`` (``base`` may be several components, e.g. the run name). ``confined``: ``anchor`` is
    an allowed root, and a link among the ``base`` folders is LinkedLocationError instead of damage."""

    def __init__(self, anchor: str, base: str = "", confined: bool = False):
        self.anchor = os.path.abspath(anchor)
        self.base = [p for p in base.split("/") if p]
        self.confined = confined

    def _parts(self, key: str) -> list[str]:
        parts = self.base + [p for p in key.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise UnsafePathError(f"{key!r}: '.' and '..' are not allowed in a key")
        return parts

    def _where(self, parts: list[str]) -> str:
        return os.path.join(self.anchor, *parts)

    @contextlib.contextmanager
    def _folder(self, parts: list[str], create: bool) -> Iterator[int]:
        """A descriptor of the folder ``parts``, walked without following links (made if ``create``)."""
        if create:
            os.makedirs(self.anchor, exist_ok=True)
        fd = os.open(self.anchor, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(parts):
                child = self._open_child(fd, part, parts[: i + 1], create)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _open_child(self, fd: int, part: str, parts: list[str], create: bool) -> int:
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not _is_link(fd, part):
                raise
            if self.confined and len(parts) <= len(self.base):
                raise LinkedLocationError(
                    f"{printable(self._where(parts))} is a symbolic link below the allowed root {self.anchor} "
                    f"(TRAIN_ALLOWED_ROOTS); a deployment run never reads or writes through links there: make it a "
                    f"real folder, or name the real one in the run's save_folder, load_path or export_on_complete"
                ) from exc
            if not create:
                raise self._damage(parts, "a symbolic link where a folder belongs") from exc
            if len(parts) <= len(self.base):  # the run folder itself: someone's choice, not ours to undo
                raise UnsafePathError(
                    f"{self._where(parts)} is a symbolic link; links are never followed below the save folder. "
                    f"Point save_folder at the real location instead"
                ) from exc
            self._remove_link(fd, part, parts)
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o755, dir_fd=fd)
        return os.open(part, _DIR_FLAGS, dir_fd=fd)

    def _damage(self, parts: list[str], what: str) -> UnsafePathError:
        where = printable(self._where(parts))  # names from the disk: escaped before they reach a terminal
        log.warning("%s is %s; it is never followed (treated as missing)", where, what)
        return UnsafePathError(f"{where}: {what} (never followed)")

    def _remove_link(self, fd: int, name: str, parts: list[str]) -> None:
        log.warning(
            "%s is a symbolic link; removing the link (not what it points to) and writing a real one",
            self._where(parts),
        )
        os.unlink(name, dir_fd=fd)

    # -- operations ----------------------------------------------------------------------------
    def read(self, key: str, chunk_size: int = _CHUNK) -> Iterator[bytes]:
        """Yields the file's bytes in chunks; UnsafePathError for a link or anything not a regular file."""
        with self.open_read(key) as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def open_read(self, key: str) -> IO[bytes]:
        """The file opened for reading, never through a link; UnsafePathError for a link or anything not a regular
        file."""
        parts = self._parts(key)
        with self._folder(parts[:-1], create=False) as folder:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._damage(parts, "a symbolic link") from exc
                raise
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise self._damage(parts, "not a regular file")
        return f

    def write(self, key: str, data: bytes) -> None:
        """Replaces ``key`` whole: a temporary file in the same folder (exclusive, never a link), fsync'ed when
        small, renamed over the name. A reader sees the old file or the new one, never half of one."""
        parts = self._parts(key)
        tmp = f".{parts[-1][:100]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with self._folder(parts[:-1], create=True) as folder:
            fd = os.open(tmp, flags, 0o644, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if len(data) <= FSYNC_UP_TO:
                        f.flush()
                        os.fsync(f.fileno())
                if _is_link(folder, parts[-1]):
                    log.warning("%s is a symbolic link; replacing the link (not what it points to)", self._where(parts))
                os.rename(tmp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
            if len(data) <= FSYNC_UP_TO:
                os.fsync(folder)  # the rename itself

    def open_write(self, key: str) -> IO[bytes]:
        """A new (truncated) regular file at ``key``, for writing; a link there is removed, not written through."""
        parts = self._parts(key)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with self._folder(parts[:-1], create=True) as folder:
            try:
                fd = os.open(parts[-1], flags, 0o644, dir_fd=folder)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                self._remove_link(folder, parts[-1], parts)
                fd = os.open(parts[-1], flags, 0o644, dir_fd=folder)
        return os.fdopen(fd, "wb")

    def create(self, key: str, data: bytes) -> bool:
        """Writes ``key`` only if nothing (not even a link) is there yet; False if something was. The bytes go to a
        temporary file first (fsync'ed), which is then hard-linked to the name: the name appears whole or not at
        all, so a kill mid-write never leaves an empty file that holds the name for good (a claim, an event)."""
        parts = self._parts(key)
        tmp = f".{parts[-1][:100]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with self._folder(parts[:-1], create=True) as folder:
            fd = os.open(tmp, flags, 0o644, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:  # link() never replaces a name, nor follows a link found there
                    os.link(tmp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
                except FileExistsError:
                    return False
                os.fsync(folder)
                return True
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)

    def copy(self, src: str, dst: str) -> None:
        """Copies file ``src`` to ``dst`` in chunks, neither through a link: a temporary file renamed over ``dst``."""
        parts = self._parts(dst)
        tmp = f".{parts[-1][:100]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with self.open_read(src) as source, self._folder(parts[:-1], create=True) as folder:
            fd = os.open(tmp, flags, 0o644, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    shutil.copyfileobj(source, f, _CHUNK)
                os.rename(tmp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise

    def make_folder(self, key: str) -> None:
        """Makes folder ``key`` and those above it, through no link."""
        with self._folder(self._parts(key), create=True):
            pass

    def rename(self, old: str, new: str) -> None:
        """Renames file ``old`` over ``new`` in the same folder (a link at ``new`` is replaced, never followed)."""
        old_parts, new_parts = self._parts(old), self._parts(new)
        if old_parts[:-1] != new_parts[:-1]:
            raise UnsafePathError(f"{old!r} -> {new!r}: a rename stays in one folder")
        with self._folder(old_parts[:-1], create=False) as folder:
            os.rename(old_parts[-1], new_parts[-1], src_dir_fd=folder, dst_dir_fd=folder)

    def kind(self, key: str) -> str | None:
        """'file', 'dir', 'other' (a link, FIFO, ...) or None when nothing is there."""
        parts = self._parts(key)
        try:
            with self._folder(parts[:-1], create=False) as folder:
                mode = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False).st_mode if parts else 0
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not parts or stat.S_ISDIR(mode):
            return "dir"
        return "file" if stat.S_ISREG(mode) else "other"

    def sizes(self, prefix: str) -> dict[str, int]:
        """Size of every file under ``prefix`` by relative path; NOT_A_FILE for links and special files."""
        found: dict[str, int] = {}
        try:
            with self._folder(self._parts(prefix), create=False) as folder:
                self._walk(folder, found, self._where(self._parts(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            pass
        return found

    def _walk(self, top: int, found: dict[str, int], where: str) -> None:
        """Depth first with a stack of open folders (no recursion: a deep tree cannot exhaust Python's stack),
        at most MAX_TREE_DEPTH of them; a folder at that depth is reported TOO_DEEP, not entered."""
        stack: list[tuple[int, Any, str]] = [(top, os.scandir(top), "")]  # (folder, its ScandirIterator, path)
        try:
            while stack:
                folder, entries, rel = stack[-1]
                entry = next(entries, None)
                if entry is None:
                    self._close(stack.pop(), top)
                    continue
                name = f"{rel}{entry.name}"
                try:
                    self._visit(entry, name, folder, stack, found, where)
                except FileNotFoundError:
                    continue  # gone since its folder was read (a temporary file renamed into place): not listed
        finally:
            for item in stack:
                self._close(item, top)

    @staticmethod
    def _visit(
        entry: Any, name: str, folder: int, stack: list[tuple[int, Any, str]], found: dict[str, int], where: str
    ) -> None:
        """Lists one entry: a file's size, NOT_A_FILE, TOO_DEEP, or a folder pushed on ``stack`` to walk."""
        if not entry.is_dir(follow_symlinks=False):
            regular = entry.is_file(follow_symlinks=False)
            found[name] = entry.stat(follow_symlinks=False).st_size if regular else NOT_A_FILE
        elif len(stack) >= MAX_TREE_DEPTH:
            log.warning(
                "%s: folders nested deeper than %d levels; not walked (damage)",
                printable(os.path.join(where, name))[:500],
                MAX_TREE_DEPTH,
            )
            found[name] = TOO_DEEP
        else:
            child = os.open(entry.name, _DIR_FLAGS, dir_fd=folder)
            try:
                stack.append((child, os.scandir(child), f"{name}/"))
            except BaseException:
                os.close(child)
                raise

    @staticmethod
    def _close(item: tuple[int, Any, str], top: int) -> None:
        folder, entries, _ = item
        entries.close()
        if folder != top:
            os.close(folder)

    def list_dirs(self, prefix: str) -> list[str]:
        """Sub-folders of ``prefix``; links to folders are damage, reported and left out."""
        names = []
        try:
            with self._folder(self._parts(prefix), create=False) as folder, os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        self._damage([*self._parts(prefix), entry.name], "a symbolic link")
                    elif entry.is_dir(follow_symlinks=False):
                        names.append(entry.name)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(names)

    def delete(self, key: str, recursive: bool = False) -> None:
        """Removes a file, a link (never its target) or, with ``recursive``, a folder; missing is fine."""
        parts = self._parts(key)
        try:
            with self._folder(parts[:-1], create=False) as folder:
                mode = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode) and recursive:
                    _remove_tree(folder, parts[-1])
                else:
                    os.unlink(parts[-1], dir_fd=folder)
        except (FileNotFoundError, NotADirectoryError):
            pass


def _remove_tree(parent: int, name: str) -> None:
    """Removes folder ``name`` of ``parent`` and all it holds, never following a link, without recursion and with
    at most MAX_TREE_DEPTH folders open (shutil.rmtree recurses: 1500 nested folders end in RecursionError,
    and one descriptor per level would run out). A folder deeper than that is first moved up into ``name``
    itself, and removed from there on a later pass."""
    top = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        while True:
            _empty_folder(top)
            try:
                os.rmdir(name, dir_fd=parent)
                return
            except OSError as exc:  # ENOTEMPTY: folders moved up while ``top`` was being read
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
    finally:
        os.close(top)


def _empty_folder(top: int) -> None:
    stack: list[tuple[int, Any, str]] = [(top, os.scandir(top), "")]  # (folder, its ScandirIterator, its name)
    try:
        while stack:
            folder, entries, _ = stack[-1]
            entry = next(entries, None)
            if entry is None:
                folder, entries, done = stack.pop()
                entries.close()
                if stack:
                    os.close(folder)
                    os.rmdir(done, dir_fd=stack[-1][0])
            elif not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.name, dir_fd=folder)
            elif len(stack) >= MAX_TREE_DEPTH:
                os.rename(entry.name, f".deep-{secrets.token_hex(8)}", src_dir_fd=folder, dst_dir_fd=top)
            else:
                child = os.open(entry.name, _DIR_FLAGS, dir_fd=folder)
                stack.append((child, os.scandir(child), entry.name))
    finally:
        for folder, entries, _ in stack:
            entries.close()
            if folder != top:
                os.close(folder)


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
