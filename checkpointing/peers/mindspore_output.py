"""MindSpore Transformers' output folders, as its own resume reads them: ``checkpoint/rank_<r>/`` and ``meta.json``.

A MindSpore Transformers run writes ``output/checkpoint/rank_<r>/{prefix}-{epoch}_{step}.ckpt`` (several per rank,
``keep_checkpoint_max`` of them) and a ``meta.json`` per rank naming the newest, ``{"last_epoch": 3, "last_step": 2,
"last_ckpt_file": "llama2_7b_rank_0-3_2.ckpt"}`` (``CheckpointMonitor.record_last_ckpt_to_json`` in mindformers);
``output/checkpoint_network/rank_<r>/`` holds weights-only files named the same way, without ``meta.json``. Its
users resume with ``load_checkpoint: './output/checkpoint'``, so ``load_path`` takes both folder levels:

- ``checkpoint/`` (rank folders only): rank 0's file. A new run here is one model: under data parallelism every rank
  holds the whole model and rank 0's file is it; a model- or pipeline-parallel run's files hold slices, which do not
  fit the model and are refused by the key/shape check like any file that does not fit;
- ``rank_<r>/`` (or any folder holding ``meta.json``): the file ``meta.json`` names; where it is missing or damaged
  (not JSON, wrong types, a name that is not a plain file name of this folder, a link), the newest file by the
  ``{epoch}_{step}`` of its name, with a warning saying so (MindSpore's own fallback is "the latest available");
- a chosen file that does not read (cut short by a dead writer, not a checkpoint, too big): one warning naming it, and
  the next newest file by ``{epoch}_{step}`` is tried, as a damaged checkpoint of ours is skipped for the one before
  it (``read``; at most MAX_TRIED files, each read bounded as any weights file).

Everything here is untrusted: ``meta.json`` is read up to 64 KiB without following a link, its fields are typed,
its file name must be one of the folder's own regular files; names are shown with ``!r``, its content never.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from checkpointing.errors import LinkedLocationError, WeightsError
from checkpointing.io import confine
from checkpointing.io.protocols import is_local_fs, open_url
from checkpointing.peers.weights import read_bounded

logger = logging.getLogger(__name__)

META = "meta.json"
META_MAX_BYTES = 64 << 10
RANK_FOLDER = re.compile(r"rank_(\d{1,6})")
# {prefix}-{epoch}_{step}.ckpt (or .safetensors, MindSpore >= 2.3); the prefix may hold '-' (a suffix MindSpore adds)
FILE_NAME = re.compile(r"(?P<prefix>.+)-(?P<epoch>\d{1,12})_(?P<step>\d{1,12})\.(?P<suffix>ckpt|safetensors)")
_MAX_NAME = 255
MAX_TRIED = 8  # files read before giving up: each may be as large as a model
T = TypeVar("T")
_WARNED: set[tuple[str, str]] = set()  # damaged files warned of in this process: the start-up check read them first


@dataclass(frozen=True)
class Chosen:
    uri: str  # the file to read
    name: str  # its name in its rank folder
    how: str  # for people: "rank_0 of a MindSpore Transformers checkpoint folder, the file meta.json names (...)"
    older: tuple[str, ...] = ()  # the folder's files older than it by {epoch}_{step}, newest first: the fallbacks


def folder_kind(names: set[str], path: str) -> str | None:
    """ "checkpoint" for a folder of rank folders (``checkpoint/``), "rank" for a rank folder (named ``rank_<r>`` or
    holding ``meta.json``, with at least one ``{prefix}-{epoch}_{step}`` file), None otherwise. ``names``: the
    folder's names (none of ours: the caller checked)."""
    files = [n for n in names if FILE_NAME.fullmatch(n)]
    if files and (META in names or RANK_FOLDER.fullmatch(posixpath.basename(path.rstrip("/")))):
        return "rank"
    if not files and any(RANK_FOLDER.fullmatch(n) for n in names):
        return "checkpoint"
    return None


def choose(uri: str, options: dict[str, Any] | None, kind: str, where: str) -> Chosen:
    """The file a MindSpore output folder ``uri`` (``folder_kind``'s ``kind``) gives a new run."""
    uri = uri.rstrip("/")
    fs, path = open_url(uri, options)
    if kind == "checkpoint":
        ranks = sorted(n for n in _names(fs, path, where) if RANK_FOLDER.fullmatch(n))
        if "rank_0" not in ranks or _kind(fs, f"{path}/rank_0", where) != "dir":
            shown = ", ".join(repr(r) for r in ranks[:4]) + (", ..." if len(ranks) > 4 else "")
            raise WeightsError(
                f"{where}: a MindSpore checkpoint folder without a rank_0 folder (it holds {shown}); name a rank "
                f"folder or a file"
            )
        if len(ranks) > 1:
            logger.info(
                "load_path: a MindSpore checkpoint folder of %d ranks: rank_0's file is the model (every rank holds "
                "the whole model under data parallelism; a model-parallel rank's slice would not fit it)",
                len(ranks),
            )
        chosen = _in_rank_folder(fs, options, f"{uri}/rank_0", f"{path}/rank_0", f"{where} (rank_0)")
        how = f"rank_0 of a MindSpore Transformers checkpoint folder, {chosen.how}"
        return Chosen(chosen.uri, chosen.name, how, chosen.older)
    chosen = _in_rank_folder(fs, options, uri, path, where)
    return Chosen(chosen.uri, chosen.name, f"a MindSpore Transformers rank folder, {chosen.how}", chosen.older)


def read(chosen: Chosen, where: str, read_file: Callable[[str, str], T]) -> tuple[Chosen, T]:
    """``read_file(uri, where)`` of ``chosen``'s file; where it raises WeightsError (the file is damaged: cut short,
    not a checkpoint, too big), one warning naming it and the next newest file of its folder is read instead. The
    first file's error is raised when none of MAX_TRIED files reads."""
    folder = chosen.uri.rsplit("/", 1)[0]
    names = (chosen.name, *chosen.older)[:MAX_TRIED]
    first: WeightsError | None = None
    for i, name in enumerate(names):
        try:
            found = read_file(f"{folder}/{name}", f"{where} ({name})")
        except WeightsError as exc:
            first = first or exc
            following = (
                f"the next newest by the {{epoch}}_{{step}} in its name: {names[i + 1]!r}"
                if i + 1 < len(names)
                else "no older file is left to try"
            )
            level = logging.INFO if (folder, name) in _WARNED else logging.WARNING  # the unit reads it again
            _WARNED.add((folder, name))
            logger.log(level, "%s: %r does not read (%s); %s", where, name, _short(exc), following)
            continue
        if i == 0:
            return chosen, found
        how = f"{chosen.how.rsplit(', ', 1)[0]}, the next newest file that reads ({name!r}; newer ones are damaged)"
        return Chosen(f"{folder}/{name}", name, how, names[i + 1 :]), found
    assert first is not None
    left = len(names) - 1
    raise WeightsError(f"{first}; and none of its {left} older file(s) read either" if left else str(first)) from first


def _in_rank_folder(
    fs: fsspec.AbstractFileSystem, options: dict[str, Any] | None, uri: str, path: str, where: str
) -> Chosen:
    names = _names(fs, path, where)
    files: dict[str, tuple[int, int, bool]] = {}
    links = 0
    for name in names:
        found = FILE_NAME.fullmatch(name)
        if found is None:
            continue
        kind = _kind(fs, f"{path}/{name}", where)
        if kind == "file":
            files[name] = (int(found["epoch"]), int(found["step"]), found["suffix"] == "ckpt")
        elif kind == "link":
            links += 1
    if links:
        logger.warning(
            "load_path %s: left out %d checkpoint file name(s) that are links (never followed)", where, links
        )
    if not files:
        raise WeightsError(f"{where}: a MindSpore rank folder with no {{prefix}}-{{epoch}}_{{step}}.ckpt file in it")
    named, problem = _meta_choice(fs, options, (uri, path), names, files, where)
    by_age = sorted(
        files, key=lambda n: (*files[n], n), reverse=True
    )  # at one {epoch}_{step}, .ckpt (MindSpore's) first
    if named is not None:
        older = tuple(by_age[by_age.index(named) + 1 :])
        return Chosen(f"{uri}/{named}", named, f"the file its meta.json names ({named!r})", older)
    newest = by_age[0]
    logger.warning(
        "load_path %s: meta.json %s; took the newest file by the {epoch}_{step} in its name instead: %r",
        where,
        problem,
        newest,
    )
    how = f"the newest file by its name ({newest!r}; meta.json {problem})"
    return Chosen(f"{uri}/{newest}", newest, how, tuple(by_age[1:]))


def _meta_choice(
    fs: fsspec.AbstractFileSystem,
    options: dict[str, Any] | None,
    folder: tuple[str, str],
    names: set[str],
    files: dict[str, tuple[int, int, bool]],
    where: str,
) -> tuple[str | None, str]:
    """(the file meta.json names, "") when it is sound, else (None, what is wrong with it)."""
    _, path = folder
    if META not in names:
        return None, "is missing"
    kind = _kind(fs, f"{path}/{META}", where)
    if kind != "file":
        return None, "is a link, not followed" if kind == "link" else "is not a regular file"
    try:
        data = _read_meta(fs, options, folder, where)
    except (WeightsError, OSError) as exc:
        return None, f"is unreadable ({exc.strerror if isinstance(exc, OSError) else _short(exc)})"
    try:
        meta = json.loads(data)
    except ValueError:
        return None, "is not JSON"
    fields = ("last_epoch", "last_step", "last_ckpt_file")
    epoch, step, name = (meta.get(k) for k in fields) if isinstance(meta, dict) else (None, None, None)
    if not (_is_count(epoch) and _is_count(step) and isinstance(name, str) and 0 < len(name) <= _MAX_NAME):
        return None, "is not {'last_epoch': int, 'last_step': int, 'last_ckpt_file': file name}"
    if "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        return None, "names a path, not a file of its own folder"
    if name not in files:
        return None, "names a file that is not one of this folder's checkpoint files"
    if files[name][:2] != (epoch, step):
        return None, "names a file whose {epoch}_{step} differs from its last_epoch/last_step"
    return name, ""


def _read_meta(
    fs: fsspec.AbstractFileSystem, options: dict[str, Any] | None, folder: tuple[str, str], where: str
) -> bytes:
    """meta.json's bytes, at most META_MAX_BYTES, never through a link (O_NOFOLLOW where no confinement does it)."""
    (uri, path), what = folder, f"{where} ({META})"
    if not is_local_fs(fs) or confine.local_roots() is not None:  # no links in object stores; confine refuses them
        return read_bounded(f"{uri}/{META}", options, what, META_MAX_BYTES)
    fd = os.open(f"{path}/{META}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > META_MAX_BYTES:
            raise WeightsError(f"{what}: not a regular file of at most {META_MAX_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(META_MAX_BYTES + 1)[:META_MAX_BYTES]
    finally:
        os.close(fd)


def _names(fs: fsspec.AbstractFileSystem, path: str, where: str) -> set[str]:
    if is_local_fs(fs) and confine.local_roots() is not None:
        return confine.names(path, where) or set()
    if is_local_fs(fs):
        return set(os.listdir(path))
    return {posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)}


def _kind(fs: fsspec.AbstractFileSystem, path: str, where: str) -> str | None:
    """'dir', 'file', 'link', 'other' or None: a local entry is looked at, never through (lstat)."""
    if is_local_fs(fs):
        if confine.local_roots() is not None:
            try:
                return confine.kind(path, where)
            except LinkedLocationError:
                return "link"
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            return "link"
        return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
    try:
        kind = fs.info(path).get("type")
    except FileNotFoundError:
        return None
    return "dir" if kind == "directory" else "file" if kind == "file" else "other"


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _short(exc: Exception) -> str:
    return str(exc).rsplit(": ", 1)[-1]
