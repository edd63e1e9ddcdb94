"""Local-folder I/O that never follows a symbolic link below the folder it was given.

A run folder may hold damage or a trap: ``state.pt`` replaced by a link to a file outside the run, to
``/dev/zero`` or to a FIFO. fsspec's local filesystem (like ``open``) follows links, so a reader could
hang or read outside the run, and a writer could overwrite a file elsewhere through the link. Here
every path is walked one component at a time from an anchor folder with ``O_NOFOLLOW`` and directory
file descriptors (``openat``), so nothing can be swapped in between the check and the use:

- reading: a link, or anything but a regular file, is reported as damage (a warning) and reads as
  missing: the checkpoint that holds it fails verification and the reader falls back;
- writing: a link where a file or folder of the run is to be written is removed (never followed) and
  replaced; a run folder that is itself a link is refused (point ``save_folder`` at the real place).

Links at or above the anchor (``save_folder`` itself on another disk, say) are the user's own choice.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from typing import IO

log = logging.getLogger(__name__)

NOT_A_FILE = -1  # the size ``sizes`` reports for a link, FIFO or device found where files belong
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafePathError(FileNotFoundError):
    """A path inside the run folder is a symbolic link or not a regular file: damage, never followed.
    A FileNotFoundError, so that readers treat it as missing and fall back."""


class LocalFiles:
    """Files under ``anchor/base`` (``base`` may be several components, e.g. the run name)."""

    def __init__(self, anchor: str, base: str = ""):
        self.anchor = os.path.abspath(anchor)
        self.base = [p for p in base.split("/") if p]

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
        where = self._where(parts)
        log.warning("%s is %s; it is never followed (treated as missing)", where, what)
        return UnsafePathError(f"{where}: {what} (never followed)")

    def _remove_link(self, fd: int, name: str, parts: list[str]) -> None:
        log.warning(
            "%s is a symbolic link; removing the link (not what it points to) and writing a real one",
            self._where(parts),
        )
        os.unlink(name, dir_fd=fd)

    # -- operations ----------------------------------------------------------------------------
    def read(self, key: str) -> Iterator[bytes]:
        """Yields the file's bytes in chunks; UnsafePathError for a link or anything not a regular file."""
        parts = self._parts(key)
        with self._folder(parts[:-1], create=False) as folder:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._damage(parts, "a symbolic link") from exc
                raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise self._damage(parts, "not a regular file")
            while chunk := f.read(16 * 1024 * 1024):
                yield chunk

    def write(self, key: str, data: bytes) -> None:
        with self.open_write(key) as f:
            f.write(data)

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
        """Writes ``key`` only if nothing (not even a link) is there yet; False if something was."""
        parts = self._parts(key)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with self._folder(parts[:-1], create=True) as folder:
            try:
                fd = os.open(parts[-1], flags, 0o644, dir_fd=folder)
            except FileExistsError:
                return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

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
                self._walk(folder, "", found)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return found

    def _walk(self, folder: int, rel: str, found: dict[str, int]) -> None:
        with os.scandir(folder) as entries:
            for entry in entries:
                name = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=folder)
                    try:
                        self._walk(child, f"{name}/", found)
                    finally:
                        os.close(child)
                elif entry.is_file(follow_symlinks=False):
                    found[name] = entry.stat(follow_symlinks=False).st_size
                else:
                    found[name] = NOT_A_FILE

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
                    shutil.rmtree(parts[-1], dir_fd=folder)  # fd-based: does not follow links inside
                else:
                    os.unlink(parts[-1], dir_fd=folder)
        except (FileNotFoundError, NotADirectoryError):
            pass


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
