"""What a training run shows in the Prefect UI, updated after every unit: progress with an ETA, a per-unit
metrics table, the loss (and eval) curves, and at the end its checkpoints and a summary.

Seen in Prefect 3.8.8's UI with headless Chromium (tests/integration/test_ui.py): a flow run's Artifacts tab
shows one card per artifact *version* with its type, key and description (not its data); the artifact's
page renders the data. Markdown artifacts render an inline ``data:image/svg+xml`` image (file:// and s3://
links are refused), so the curves are an SVG inside a markdown artifact. Creating an artifact again under
the same key adds a card to the run, so each artifact of a flow run is created once and then updated in
place by id (Prefect's artifact PATCH, which also moves the key's "latest"). A crash-restart runs the same
flow run again (``run_count`` + 1): the report first looks up this flow run's artifacts through the API and
takes them over, so the progress card of the killed attempt is the one that moves on, and the metrics
table keeps that attempt's rows.

The checkpoints are the record; artifacts are only a report of them. So publishing one never fails
training: an error here is logged as a warning and the run goes on.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any
from uuid import UUID

import httpx
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.runtime import flow_run

from checkpointing import CheckpointInfo, CheckpointStore
from checkpointing.io.redact import redact_uri
from flows import artifact_content as content
from flows.artifact_content import cell, md_code, md_escape
from flows.restarts import flow_run_attempt
from flows.run_summary import summary_markdown
from training.config import TrainConfig
from training.preemption import Preempted
from training.unit.loop import UnitResult

logger = logging.getLogger(__name__)

LOSS_CURVE = "loss.svg"
PAUSE_SECONDS = 60  # after a failed publish
TABLE_ROWS = 100  # newest rows in each table: checkpoints verify one folder listing each; units grow without end
KINDS = {
    "progress": "progress",
    "metrics": "table",
    "curves": "markdown",
    "checkpoints": "table",
    "summary": "markdown",
}
_CREATE = {"progress": create_progress_artifact, "table": create_table_artifact, "markdown": create_markdown_artifact}


def artifact_key(run_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run"
    return f"train-{slug}-{what}"


class Card:
    """One artifact of this flow run: created once, then updated in place by id (one card in the UI)."""

    def __init__(self, key: str, kind: str, artifact_id: UUID | None = None):
        self.key, self.kind, self.id = key, kind, artifact_id

    def publish(self, data, description: str) -> None:
        if self.id is not None:
            payload = json.dumps(data, allow_nan=False) if self.kind == "table" else data
            try:
                with get_client(sync_client=True) as client:
                    client.update_artifact(self.id, ArtifactUpdate(data=payload, description=description))
                return
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 404:
                    raise
                self.id = None  # deleted meanwhile (in the UI, say): a new card is better than none
        create: Any = _CREATE[self.kind]
        self.id = create(data, key=self.key, description=description)


def existing_artifacts(keys: list[str]) -> dict[str, list]:
    """This flow run's artifacts under ``keys``, newest first (an earlier attempt's, after a restart)."""
    if flow_run.id is None:
        return {}
    found: dict[str, list] = {}
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run.id)]), key=ArtifactFilterKey(any_=keys)
            ),
            sort=ArtifactSort.CREATED_DESC,
        )
        for artifact in artifacts:
            if artifact.key is not None:
                found.setdefault(artifact.key, []).append(artifact)
        for versions in found.values():  # two attempts racing each created one: keep the newest card only
            for stale in versions[1:]:
                client.delete_artifact(stale.id)
    return found


class RunReport:
    """The artifacts of one flow run of ``train``: call ``unit_done`` after each unit, ``finish`` at the end."""

    def __init__(self, config: TrainConfig, store: CheckpointStore, start: CheckpointInfo | None):
        self.config, self.store = config, store
        self.paused_until = 0.0
        self.attempt = flow_run_attempt()
        self.started_at = time.monotonic()
        self.progress: dict[str, int] = dict(start.progress) if start else {}
        self.start_samples = self.progress.get("samples_seen", 0)
        self.num_train_samples: int | None = None
        self.rows: dict[str, dict] = {}  # by checkpoint name: every unit of the run known so far
        keys = {what: artifact_key(config.run_name, what) for what in KINDS}
        found = self._quietly("looking up this flow run's artifacts", existing_artifacts, list(keys.values())) or {}
        self.cards = {
            what: Card(keys[what], kind, found[keys[what]][0].id if keys[what] in found else None)
            for what, kind in KINDS.items()
        }
        self._quietly("reading earlier units from the store", self._load_history_from_store)
        self._quietly(
            "reading the killed attempt's table", self._load_history_from_table, found.get(keys["metrics"], [])
        )
        self._publish_progress(note="starting" if self.attempt == 1 else "restarted")

    def unit_done(self, unit: UnitResult) -> None:
        """Moves the progress bar and adds the unit to the metrics table and the curves."""
        self.progress = dict(unit.progress or {})
        self.num_train_samples = getattr(unit, "num_train_samples", None) or self.num_train_samples
        self.rows[unit.checkpoint_name] = content.unit_row(unit, self.attempt)
        loss = (unit.metrics or {}).get(content.LOSS)
        note = f"unit {unit.unit} done" + (f": train_loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
        self._publish_progress(note=note)
        self._publish_units()

    def finish(self, units: list[UnitResult], metrics: dict[str, float], started_from: str) -> None:
        """Completes the progress bar; publishes the checkpoint table, the curves (also to loss.svg) and the summary."""
        done = self.progress.get("samples_seen", 0)
        elapsed = content.duration_text(time.monotonic() - self.started_at)
        text = f"complete · {content.progress_text(done, done, None, self.attempt)} · this attempt took {elapsed}"
        self._publish("progress", 100.0, text)
        checkpoints = self._quietly("listing checkpoints", self.store.list) or []
        self._quietly("building the checkpoint table", self._publish_checkpoints, checkpoints)
        self._publish_units()
        series = content.curves(content.sorted_rows(self.rows))
        curve_uri = self._quietly("writing loss.svg", self.write_loss_curve, series)
        self._publish(
            "summary",
            summary_markdown(self.config, self.store, units, metrics, started_from, checkpoints, curve_uri, series),
            f"Summary of {md_escape(self.config.run_name)}",
        )

    def stopped(self, stop: Preempted) -> None:
        """Says in the UI why this attempt ended early and what the restart resumes from."""
        text = stop.describe() + ("; the restart will resume from it" if stop.checkpoint else "")
        self._publish("progress", self._percent(), f"stopped · {text}")
        self._publish(
            "summary",
            f"### {md_escape(self.config.run_name)}: stopped\n\n{md_escape(text)}\n",
            f"Summary of {md_escape(self.config.run_name)}",
        )

    # -- pieces ------------------------------------------------------------------------------------
    def _load_history_from_store(self) -> None:
        """Units committed before this attempt, by this or an earlier flow run: their manifests' metrics. What a
        roll-back set aside (resume_from) is not on the run's path any more, and is left out of the curves."""
        infos = self.store.list()
        set_aside = set(self.store.set_aside(infos))
        for info in infos:
            if info.name not in set_aside:
                self.rows[info.name] = content.manifest_row(info, unit_of(info.progress, self.config))

    def _load_history_from_table(self, metrics_versions: list) -> None:
        """The rows this flow run's killed attempt published (they also have checkpoint seconds and resumed-from)."""
        if metrics_versions:
            for line in json.loads(metrics_versions[0].data or "[]"):
                row = content.row_from_table(line)
                self.rows[row["checkpoint"]] = row

    def _percent(self) -> float:
        done = self.progress.get("samples_seen", 0)
        total = self._total()
        if total:
            return round(min(100.0, 100.0 * done / total), 2)
        return percent_done(self.config, self.progress, self.num_train_samples)

    def _total(self) -> int | None:
        return content.total_samples(
            self.config.duration, self.progress, self.num_train_samples, self.config.global_batch_size
        )

    def _publish_progress(self, note: str) -> None:
        done = self.progress.get("samples_seen", 0)
        elapsed = time.monotonic() - self.started_at
        rate = (done - self.start_samples) / elapsed if done > self.start_samples and elapsed > 0 else None
        text = f"{note} · {content.progress_text(done, self._total(), rate, self.attempt)}"
        self._publish("progress", self._percent(), text)

    def _publish_units(self) -> None:
        rows = content.sorted_rows(self.rows)
        shown = rows[-TABLE_ROWS:]
        cut = f"newest {len(shown)} of {len(rows)} units (TABLE_ROWS={TABLE_ROWS})" if len(rows) > len(shown) else ""
        self._publish(
            "metrics",
            content.table(shown),
            f"Per-unit metrics of {md_escape(self.config.run_name)}: {cut or f'all {len(rows)} units'}",
        )
        series = content.curves(rows)
        if series:
            self._publish("curves", *self._curves_markdown(series))

    def _curves_markdown(self, series: dict) -> tuple[str, str]:
        name = md_escape(self.config.run_name)
        svg = content.curve_svg(series, f"{self.config.run_name}: per unit")
        body = f"### Curves of {name}, one point per unit\n\n{content.svg_image(svg, 'curves')}\n\n"
        body += content.curve_summary(series)
        loss = [v for _, v in series.get(content.LOSS, [])]
        description = (
            f"training loss {content.sparkline(loss)} {loss[-1]:.4g} after {content.plural(len(loss), 'unit')}"
            if loss
            else f"curves of {name}"
        )
        return body, description

    def _publish_checkpoints(self, checkpoints: list[CheckpointInfo]) -> None:
        shown = checkpoints[-TABLE_ROWS:]
        if len(shown) < len(checkpoints):
            extent = (
                f"newest {len(shown)} of {len(checkpoints)} (TABLE_ROWS={TABLE_ROWS}; "
                f"{md_code(f'python -m checkpointing ls {redact_uri(self.store.uri)}')} lists all)"
            )
        else:
            extent = f"all {len(checkpoints)}"
        self._publish(
            "checkpoints",
            self.checkpoint_rows(shown),
            f"Checkpoints of {md_escape(self.config.run_name)} in {md_code(redact_uri(self.store.uri))}: {extent}",
        )

    def checkpoint_rows(self, checkpoints: list[CheckpointInfo]) -> list[dict]:
        rows = []
        for info in checkpoints:
            seconds = (self.rows.get(info.name) or {}).get("checkpoint_seconds")
            rows.append(
                {
                    "name": cell(info.name),
                    "epoch": info.progress.get("epoch", 0),
                    "step": info.progress.get("step", 0),
                    "samples": info.progress.get("samples_seen", 0),
                    "size_mb": round(info.size_bytes / 1e6, 3),
                    "verified": not self.store.check(info),
                    "seconds_to_save": round(seconds, 3) if seconds is not None else None,
                }
            )
        return rows

    def write_loss_curve(self, series: dict) -> str | None:
        """Writes ``<run>/loss.svg`` next to the checkpoints, for readers of the store outside the UI."""
        if not series:
            return None
        svg = content.curve_svg(series, f"{self.config.run_name}: per unit")
        self.store.storage.put(LOSS_CURVE, svg.encode())
        return self.store.storage.uri(LOSS_CURVE)

    def _publish(self, what: str, data, description: str) -> None:
        """Creates or updates one card. After a failure the report stays quiet for PAUSE_SECONDS: each call to
        an unreachable API costs ~1.5 s here, which training should not pay three times a unit."""
        if time.monotonic() < self.paused_until:
            return
        try:
            self.cards[what].publish(data, description)
        except Exception as exc:
            self.paused_until = time.monotonic() + PAUSE_SECONDS
            logger.warning(
                "could not publish the %s artifact of %s: %s: %s; publishing none for %d s",
                what,
                self.config.run_name,
                type(exc).__name__,
                exc,
                PAUSE_SECONDS,
            )

    def _quietly(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            logger.warning(
                "run report of %s: %s failed (%s: %s); training goes on",
                self.config.run_name,
                what,
                type(exc).__name__,
                exc,
            )
            return None


def unit_of(progress: dict[str, int], config: TrainConfig) -> int:
    """The unit that ended at ``progress`` (a manifest does not record it)."""
    interval = config.interval
    if interval.unit == "ep":
        epoch = progress.get("epoch", 0)
        return (epoch - 1 if progress.get("sample_in_epoch", 0) == 0 and epoch else epoch) // interval.value
    return max(progress.get("step", 0) - 1, 0) // interval.value


def percent_done(config: TrainConfig, progress: dict[str, int], num_train_samples: int | None) -> float:
    """How far training is toward ``max_duration``, in percent."""
    duration = config.duration
    done: float
    if duration.unit == "ba":
        done = progress.get("step", 0)
    elif duration.unit == "ep":
        done = progress.get("epoch", 0)
        if num_train_samples:
            done += progress.get("sample_in_epoch", 0) / num_train_samples
    else:  # samples ("<n>sp")
        done = progress.get("samples_seen", 0)
    return round(min(100.0, 100.0 * done / duration.value), 2)
