"""Folders and files that the stack, run as root, may trust: ones that it, root or its own user made, reached
without following a link that anyone else could have planted.

The stack runs as root in containers and CI, and its PostgreSQL runs as another user. Any local user can make
links, folders and files in shared places (/tmp, /var/tmp) before the stack looks: a folder or file the stack
adopted there lets them choose where root writes, hand root's folders to the server's user, or set the
database's password (issue 31). So everything here works on descriptors (``openat`` with ``O_NOFOLLOW``,
``fstat``, ``fchown``): what was checked is what is used.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UntrustedPath(RuntimeError):
    """A folder or file on the way is not one the stack may trust; the message says which and why."""


def open_folder(path: Path, create_mode: int | None = None) -> int:
    """An ``O_DIRECTORY`` descriptor of ``path``; made (with the missing folders above it, 0755) when ``create_mode``
    is given, else FileNotFoundError when it is missing.

    Links on the way are followed only where root or this user made them; then every folder from / down is opened
    without following links, must belong to root or this user and be writable by no one else (above ``path`` a
    sticky folder such as /tmp may be: no one else can replace what is in it). ``path`` itself is this user's."""
    path = Path(os.path.abspath(path))
    _check_links(path)
    parts = [*Path(os.path.realpath(path.parent)).parts[1:], path.name]
    fd = os.open("/", _DIR)
    try:
        for depth, name in enumerate(parts, 1):
            where, last = Path("/", *parts[:depth]), depth == len(parts)
            if create_mode is not None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, create_mode if last else 0o755, dir_fd=fd)
            child = _open_child(name, fd, where)
            os.close(fd)
            fd = child
            _check_folder(fd, where, last)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_file(dir_fd: int, name: str) -> str | None:
    """The text of ``name`` in the folder ``dir_fd`` (None if there is none): a regular file of this user's alone,
    opened without following a link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise UntrustedPath(f"{name} is not a file of this user's ({error.strerror})") from None
    _check_file(fd, name)
    with os.fdopen(fd) as f:
        return f.read()


def write_file(dir_fd: int, name: str, text: str, owner: pwd.struct_passwd | None = None) -> None:
    """Replaces ``name`` in the folder ``dir_fd`` at once by a fresh file (mode 0600; given to ``owner`` on its
    descriptor): whatever was there, link or file, is never written through."""
    temporary = f".{name}.{secrets.token_hex(6)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        if owner is not None:
            os.fchown(f.fileno(), owner.pw_uid, owner.pw_gid)
    os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def open_append(path: Path) -> int:
    """A descriptor appending to ``path`` (made 0600 if missing), a regular file of this user's with no other name,
    in a folder ``open_folder`` trusts."""
    dir_fd = open_folder(path.parent)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path.name, flags, 0o600, dir_fd=dir_fd)
        except OSError as error:
            raise UntrustedPath(f"{path} is not a file of this user's ({error.strerror})") from None
    finally:
        os.close(dir_fd)
    _check_file(fd, path)
    return fd


def _open_child(name: str, dir_fd: int, where: Path) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as error:  # ELOOP: a link; ENOTDIR: a file
        raise UntrustedPath(f"{where} is not a folder but a link or a file ({error.strerror})") from None


def _check_links(path: Path) -> None:
    """Refuses a link on the way to ``path`` that someone other than root or this user made."""
    for prefix in [*reversed(path.parents), path][1:]:
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            raise UntrustedPath(f"{prefix} is a link made by {_name(st.st_uid)}")


def _check_folder(fd: int, where: Path, last: bool) -> None:
    st = os.fstat(fd)
    owners = (os.geteuid(),) if last else (0, os.geteuid())
    if st.st_uid not in owners:
        raise UntrustedPath(f"{where} belongs to {_name(st.st_uid)}, not to {_name(os.geteuid())}")
    if st.st_mode & 0o022 and (last or not st.st_mode & stat.S_ISVTX):
        raise UntrustedPath(f"{where} may be changed by others (mode {stat.filemode(st.st_mode)})")


def _check_file(fd: int, where: object) -> None:
    st = os.fstat(fd)
    checks = (
        (not stat.S_ISREG(st.st_mode), "is not a regular file"),
        (st.st_uid != os.geteuid(), f"belongs to {_name(st.st_uid)}"),
        (st.st_nlink != 1, "has another name (a hard link)"),
        (bool(st.st_mode & 0o022), f"may be changed by others (mode {stat.filemode(st.st_mode)})"),
    )
    problem = next((what for bad, what in checks if bad), None)
    if problem:
        os.close(fd)
        raise UntrustedPath(f"{where} {problem}")


def _name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
