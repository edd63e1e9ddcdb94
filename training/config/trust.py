"""Where a run may read and write, as the worker's environment allows: never a flow-run parameter's choice.

Anyone who may create runs of a deployment chooses its parameters. A recipe is code, so the recipes a run may
name are an allow-list of the worker (training/recipe/loader.py). Storage is the same kind of power: ``load_path`` could
read another team's checkpoint (or ``/etc/passwd``) into the creator's run, ``export_on_complete`` could write
anywhere the worker can, and ``save_folder`` could point the worker's credentials at any bucket. So when a run's
parameters are untrusted (a deployment run: ``Run.open(untrusted=True)``), every location it names must lie under
a root the worker allows:

    TRAIN_ALLOWED_ROOTS="s3://team-bucket/runs,/mnt/shared/weights"    # comma-separated, in the worker's env

Unset, the worker allows one root: its own default ``save_folder`` (``TRAIN_SAVE_FOLDER``, else ``runs`` in the
flow's working directory). The check runs before any I/O, so a refused location's existence, size and type are
never revealed, and the message quotes the option's value, never a byte of any file. A local path is compared as
written, and no folder or file on its way below the root may be a symbolic link (links at or above a root are the
operator's own). A check by path holds only until the path changes: ``confine_locations`` also confines this
process's local files to the roots until the run ends, each reached from its root without following a link at the
moment it is opened (checkpointing/io/confine.py), so a folder replaced by a link mid-run, or a link inside an allowed
weights folder, fails the run in one line. ``python -m flows.train`` and ``train()`` called from Python are the
person's own choices and are not checked.

Data is a location too. Every URL in ``recipe_args`` (``data_url``, ``val_url``, at any depth) must lie under a root
when the run opens, and the product's readers check the URL they are given in every process of a confined run
(``check_read_location``: ShardedDataset, before it lists, reads, caches or writes anything; the object-store roots
travel with the local ones in checkpointing/io/confine.py, to the rank processes too). Storage options choose where
requests go and whose credentials sign them: ``recipe_args`` may hold none (``data_options``, ``storage_options``),
and the data is read with the worker's ``TRAIN_DATA_STORAGE_OPTIONS`` (JSON in its environment).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import fsspec

from checkpointing.io import confine
from checkpointing.io.localfs import LinkedLocationError
from training.config import ConfigError, TrainConfig

ROOTS_ENV = "TRAIN_ALLOWED_ROOTS"
LOCATIONS = ("save_folder", "load_path", "export_on_complete")
_LOCAL = ("file", "local")
DATA_OPTIONS_ENV = "TRAIN_DATA_STORAGE_OPTIONS"  # the worker's storage options for data (training/data/dataset.py)
STORAGE_OPTION_KEYS = ("data_options", "storage_options")  # recipe_args keys that would hold storage options
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(::[A-Za-z][A-Za-z0-9+.-]*)*://")


def allowed_roots() -> list[str]:
    """The roots this worker allows, normalized (``protocol://path`` or an absolute local path)."""
    raw = os.environ.get(ROOTS_ENV)
    if raw is None:
        raw = os.environ.get("TRAIN_SAVE_FOLDER") or str(TrainConfig.model_fields["save_folder"].default)
    roots = [_normalized(item.strip(), ROOTS_ENV) for item in raw.split(",") if item.strip()]
    return [r for r in roots if r is not None]


def local_root_forms() -> list[str]:
    """The local roots, as written and with their own links resolved: a location may be written under either."""
    local = [root for root in allowed_roots() if root.startswith("/")]
    return sorted(set(local) | {os.path.realpath(root) for root in local})


def confined_root_forms() -> list[str]:
    """What a confined run's processes are confined to: the local roots' forms and the object-store roots."""
    return local_root_forms() + [root for root in allowed_roots() if not root.startswith("/")]


def confine_locations(config: TrainConfig) -> None:
    """``check_locations``, then this process's local files stay confined to the roots (each opened from its root,
    through no link) until ``release_locations``: a deployment run's whole life. The object-store roots are in force
    too, for the product's readers of URLs a run names (``check_read_location``)."""
    confine.enter(confined_root_forms())
    try:
        check_locations(config)
    except BaseException:
        confine.leave()
        raise


def release_locations() -> None:
    confine.leave()


def check_locations(config: TrainConfig) -> None:
    """ConfigError unless every location ``config`` names lies under a root this worker allows, with no link below
    the root on its way; ``recipe_args`` too: no storage options, and every URL in them under a root."""
    roots = allowed_roots() + local_root_forms()
    for option in LOCATIONS:
        value = getattr(config, option)
        if value is not None:
            _check_within(str(value), option, roots, allowed_roots())
    check_recipe_args(config.recipe_args, roots)


def check_recipe_args(args: Any, roots: list[str]) -> None:
    """A run's ``recipe_args`` choose no storage options (``data_options``, ``storage_options``: they decide where
    requests go and whose credentials sign them), and every URL in them (``s3://...``, ``file://...``: whatever a
    recipe may hand a product reader, at any depth) lies under a root."""
    leaves = list(_leaves(args, "recipe_args", 0))
    for name, value in leaves:  # first: the same line whatever order the parameter's keys arrive in
        if name.rsplit(".", 1)[-1].lower().replace("-", "_") in STORAGE_OPTION_KEYS:
            refuse_storage_options(value, name)
    for name, value in leaves:
        if isinstance(value, str) and _URL.match(value):
            _check_within(value, name, roots, allowed_roots())


def refuse_storage_options(options: Any, option: str) -> None:
    """ConfigError for storage options a deployment run's parameters hold (none is fine), naming the first key."""
    if not options:
        return
    key = next(iter(options), "") if isinstance(options, dict) else ""
    raise ConfigError(
        f"{option}{f'.{key}' if key else ''}: a deployment run's parameters cannot choose storage options (they "
        f"decide where requests go and whose credentials sign them); set them in the worker's environment instead "
        f"({DATA_OPTIONS_ENV} for data, as JSON; TRAIN_STORAGE_OPTIONS for save_folder)"
    )


def check_read_location(value: str, option: str) -> None:
    """In a confined run (a deployment run, and the processes it starts), ConfigError unless ``value`` lies under
    one of the roots in force: what a product reader calls before it opens a URL a run may have named (the data's
    folder or bucket), so a refused location is never listed, read, cached or written to. Elsewhere nothing."""
    roots = confine.roots()
    if roots is None:
        return
    _check_within(value, option, roots, roots, confine.local_roots())


def _check_within(
    value: str, option: str, roots: list[str], shown: list[str], local_roots: list[str] | None = None
) -> None:
    where = _normalized(value, option)
    if where is None or not any(_within(where, root) for root in roots):
        raise ConfigError(
            f"{option}={value!r} is outside the locations this worker allows ({ROOTS_ENV}="
            f"{','.join(shown) or 'nothing'}); use a location under one of them, or ask the worker's operator to "
            f"add one to {ROOTS_ENV} in the worker's environment"
        )
    if where.startswith("/"):
        _check_no_link(value, option, local_roots)


def _leaves(value: Any, name: str, depth: int) -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every entry of a JSON value (bounded depth: recipe_args are bounded when parsed)."""
    yield name, value
    if depth > 32:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{name}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{name}[{i}]", depth + 1)


def _normalized(value: str, option: str) -> str | None:
    """``protocol://bucket/path`` without a trailing slash, or an absolute local path as written; None for a
    remote URL with '.', '..' or empty segments (which stores and fsspec read in different ways)."""
    protocol, path = fsspec.core.split_protocol(value)
    protocol = (protocol or "file").lower()
    if protocol in _LOCAL:
        return _local(path)
    segments = path.rstrip("/").split("/")
    if any(s in ("", ".", "..") for s in segments):
        return None
    return f"{protocol}://{'/'.join(segments)}"


def location_within(value: str, folder: str) -> bool:
    """Whether the location ``value`` is ``folder`` or lies below it, both normalized as the roots are (a local
    path made absolute, so '..' is resolved; a remote URL with '.', '..' or empty segments lies nowhere): the one
    comparison of locations for every rule that confines one (a sweep's copies and checkpoints too)."""
    where, root = _normalized(value, "location"), _normalized(folder, "folder")
    return where is not None and root is not None and _within(where, root)


def _within(where: str, root: str) -> bool:
    return where == root or where.startswith(root.rstrip("/") + "/")


def _local(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _check_no_link(value: str, option: str, local_roots: list[str] | None = None) -> None:
    """ConfigError when a folder or file on the way from the root to a local ``value`` is a symbolic link."""
    with confine.confined(local_root_forms() if local_roots is None else local_roots):
        try:
            confine.check(fsspec.core.split_protocol(value)[1], f"{option}={value!r}")
        except LinkedLocationError as exc:
            raise ConfigError(str(exc)) from None
