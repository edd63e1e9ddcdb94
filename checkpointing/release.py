"""The released model of a save folder: ``<save_folder>/release.json``, which scheduled retraining
(flows/retrain.py) warm-starts from and rewrites when it promotes a model.

The file lies in the bucket beside the runs, where anyone who may write the bucket may write it, so it is
read as untrusted input: at most ``MAX_RELEASE_BYTES``, one JSON object, each field of its type, finite
scores, and a checkpoint inside this save folder (``<save_folder>/<run_name>/checkpoints/<name>``, both names
checked with ``validate_name``). The warm start loads that URI: a release must not point it at another
bucket, a local file or a path out of the folder. Anything else is a ``ReleaseError``, never "no release
yet" (a tick would then promote a model from scratch over the real release). Reads and writes go through
``Storage``: transient faults are retried with the store's settings, and a local link is never followed.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from checkpointing.errors import DamagedFileError, ReleaseError, UnsafePathError
from checkpointing.io.storage import RetrySettings, Storage
from checkpointing.io.untrusted import read_json
from checkpointing.store import CHECKPOINTS, validate_name
from checkpointing.uris import split_run_uri

RELEASE = "release.json"
MAX_RELEASE_BYTES = 64 * 1024
_MAX_METRICS = 256
_MAX_TEXT = 256


@dataclass(frozen=True)
class Release:
    """The promoted model: which checkpoint, and how it scored."""

    run_name: str
    checkpoint: str
    metric: str
    value: float
    metrics: dict[str, float]
    promoted_at: float
    flow_run_id: str | None = None


class ReleaseFile:
    """``<save_folder>/release.json``, read and written with the store's retry policy."""

    def __init__(
        self, save_folder: str, *, storage_options: dict[str, Any] | None = None, retry: RetrySettings | None = None
    ):
        self.storage = Storage(str(save_folder), storage_options, retry)
        self.uri = self.storage.uri(RELEASE)

    def read(self) -> Release | None:
        """The current release, or None before the first promotion; ReleaseError for a file not to be trusted."""
        try:
            raw = read_json(self.storage, RELEASE, MAX_RELEASE_BYTES, allow_nan=False)
        except UnsafePathError as exc:
            raise ReleaseError(f"{self.uri}: {exc}") from exc
        except FileNotFoundError:
            return None
        except DamagedFileError as exc:
            raise ReleaseError(f"{self.uri}: {exc}; not a release file") from exc
        return self._checked(raw)

    def write(self, release: Release) -> None:
        """Replaces the release; refuses one that ``read`` would refuse."""
        checked = self._checked(asdict(release))
        self.storage.put(RELEASE, json.dumps(asdict(checked), indent=1, allow_nan=False).encode())

    def checkpoint_uri(self, run_name: str, name: str) -> str:
        """Where checkpoint ``name`` of run ``run_name`` lies in this save folder."""
        return self.storage.uri(f"{validate_name(run_name)}/{CHECKPOINTS}/{validate_name(name, 'checkpoint name')}")

    def _checked(self, raw: Any) -> Release:
        if not isinstance(raw, dict):
            raise ReleaseError(f"{self.uri}: a JSON {type(raw).__name__}, not an object")
        try:
            release = Release(
                run_name=validate_name(_text(raw["run_name"], "run_name")),
                checkpoint=_text(raw["checkpoint"], "checkpoint", limit=2048),
                metric=_text(raw["metric"], "metric"),
                value=_finite(raw["value"], "value"),
                metrics=_metrics(raw["metrics"]),
                promoted_at=_finite(raw["promoted_at"], "promoted_at"),
                flow_run_id=None if raw.get("flow_run_id") is None else _text(raw["flow_run_id"], "flow_run_id"),
            )
            _, run, name = split_run_uri(release.checkpoint)
            expected = self.checkpoint_uri(release.run_name, name or "")
        except KeyError as exc:
            raise ReleaseError(f"{self.uri}: no {exc.args[0]!r} field") from exc
        except ValueError as exc:
            raise ReleaseError(f"{self.uri}: {exc}") from exc
        if run != release.run_name or release.checkpoint != expected:
            raise ReleaseError(
                f"{self.uri}: checkpoint={release.checkpoint[:300]!r} is not a checkpoint of run "
                f"{release.run_name!r} in this save folder ({expected!r} expected)"
            )
        return release


def _text(value: Any, what: str, limit: int = _MAX_TEXT) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise ValueError(f"{what}={str(value)[:80]!r}: expected a string of 1-{limit} characters")
    return value


def _finite(value: Any, what: str) -> float:
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an integer too big for a float
            number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what}={str(value)[:80]!r}: expected a finite number")
    return number


def _metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > _MAX_METRICS:
        raise ValueError(f"metrics: expected an object of at most {_MAX_METRICS} numbers")
    return {_text(key, "metric name"): _finite(number, f"metrics[{key!r}]") for key, number in value.items()}
