"""Where a run may read and write, as the worker's environment allows: never a flow-run parameter's choice.

Anyone who may create runs of a deployment chooses its parameters. A recipe is code, so the recipes a run may
name are an allow-list of the worker (training/recipe.py). Storage is the same kind of power: ``load_path`` could
read another team's checkpoint (or ``/etc/passwd``) into the creator's run, ``export_on_complete`` could write
anywhere the worker can, and ``save_folder`` could point the worker's credentials at any bucket. So when a run's
parameters are untrusted (a deployment run: ``Run.open(untrusted=True)``), every location it names must lie under
a root the worker allows:

    TRAIN_ALLOWED_ROOTS="s3://team-bucket/runs,/mnt/shared/weights"    # comma-separated, in the worker's env

Unset, the worker allows one root: its own default ``save_folder`` (``TRAIN_SAVE_FOLDER``, else ``runs`` in the
flow's working directory). The check runs before any I/O, so a refused location's existence, size and type are
never revealed, and the message quotes the option's value, never a byte of any file. A local path is compared
after resolving links (a link inside a root to a file outside it is outside). ``python -m flows.train`` and
``train()`` called from Python are the person's own choices and are not checked.
"""

from __future__ import annotations

import os

import fsspec

from training.config import ConfigError, TrainConfig

ROOTS_ENV = "TRAIN_ALLOWED_ROOTS"
LOCATIONS = ("save_folder", "load_path", "export_on_complete")
_LOCAL = ("file", "local")


def allowed_roots() -> list[str]:
    """The roots this worker allows, normalized (``protocol://path`` or an absolute local path)."""
    raw = os.environ.get(ROOTS_ENV)
    if raw is None:
        raw = os.environ.get("TRAIN_SAVE_FOLDER") or str(TrainConfig.model_fields["save_folder"].default)
    roots = [_normalized(item.strip(), ROOTS_ENV) for item in raw.split(",") if item.strip()]
    return [r for r in roots if r is not None]


def check_locations(config: TrainConfig) -> None:
    """ConfigError unless every location ``config`` names lies under a root this worker allows."""
    roots = allowed_roots()
    for option in LOCATIONS:
        value = getattr(config, option)
        if value is None:
            continue
        where = _normalized(str(value), option)
        if where is None or not any(_within(where, root) for root in roots):
            raise ConfigError(
                f"{option}={value!r} is outside the locations this worker allows ({ROOTS_ENV}="
                f"{','.join(roots) or 'nothing'}); use a location under one of them, or ask the worker's operator to "
                f"add one to {ROOTS_ENV} in the worker's environment"
            )


def _normalized(value: str, option: str) -> str | None:
    """``protocol://bucket/path`` without a trailing slash, or a local path with its links resolved; None for a
    remote URL with '.', '..' or empty segments (which stores and fsspec read in different ways)."""
    protocol, path = fsspec.core.split_protocol(value)
    protocol = (protocol or "file").lower()
    if protocol in _LOCAL:
        return os.path.realpath(os.path.abspath(os.path.expanduser(path)))
    segments = path.rstrip("/").split("/")
    if any(s in ("", ".", "..") for s in segments):
        return None
    return f"{protocol}://{'/'.join(segments)}"


def _within(where: str, root: str) -> bool:
    return where == root or where.startswith(root.rstrip("/") + "/")
