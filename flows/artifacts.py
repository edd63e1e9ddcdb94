"""What a training run shows in the Prefect UI: live progress, its checkpoints, a summary, a loss curve.

The checkpoints are the record; artifacts are only a report of them. So publishing one never fails
training: an error here is logged as a warning and the run goes on. Everything is read from the
store (manifests carry progress and each unit's training loss), so the report also covers units
trained before a restart, by another process.
"""

from __future__ import annotations

import html
import logging
import re
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.runtime import flow_run

from checkpointing import CheckpointInfo, CheckpointStore
from training.config import TrainConfig
from training.loop import UnitResult

LOSS_CURVE = "loss.svg"
TABLE_ROWS = 100  # newest checkpoints in the table: verifying each one lists its folder in the store


def artifact_key(run_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run"
    return f"train-{slug}-{what}"


class RunReport:
    """The artifacts of one flow run of ``train``: call ``unit_done`` after each unit, ``finish`` at the end."""

    def __init__(
        self,
        config: TrainConfig,
        store: CheckpointStore,
        start: CheckpointInfo | None,
        log: logging.Logger | logging.LoggerAdapter,
    ):
        self.config, self.store, self.log = config, store, log
        self.checkpoint_seconds: dict[str, float | None] = {}
        percent = percent_done(config, start.progress if start else {}, None)
        self.progress_id: UUID | None = self._quietly(
            "progress",
            create_progress_artifact,
            percent,
            key=artifact_key(config.run_name, "progress"),
            description=f"Training progress of {config.run_name} toward {config.max_duration}",
        )

    def unit_done(self, unit: UnitResult) -> None:
        """Moves the progress bar and remembers how long the unit's checkpoint took to save."""
        self.checkpoint_seconds[unit.checkpoint_name] = unit.metrics.get("checkpoint_seconds")
        if self.progress_id is not None:
            percent = percent_done(self.config, unit.progress, unit.num_train_samples)
            self._quietly(
                "progress",
                update_progress_artifact,
                self.progress_id,
                percent,
                description=f"unit {unit.unit} done: loss {unit.metrics.get('loss', float('nan')):.4f}, "
                f"checkpoint {unit.checkpoint_name}",
            )

    def finish(self, units: list[UnitResult], metrics: dict[str, float], started_from: str) -> None:
        """Publishes the checkpoint table, the loss curve and the summary."""
        if self.progress_id is not None:
            self._quietly(
                "progress",
                update_progress_artifact,
                self.progress_id,
                100.0,
                description=f"{self.config.run_name} complete",
            )
        name = self.config.run_name
        checkpoints = self._quietly("checkpoint list", self.store.list) or []
        self._quietly(
            "checkpoint table",
            lambda: create_table_artifact(
                self.checkpoint_rows(checkpoints),
                key=artifact_key(name, "checkpoints"),
                description=f"Checkpoints of {name} in {self.store.uri}",
            ),
        )
        curve_uri = self._quietly("loss curve", self.write_loss_curve, checkpoints)
        self._quietly(
            "summary",
            lambda: create_markdown_artifact(
                summary_markdown(self.config, self.store, units, metrics, started_from, checkpoints, curve_uri),
                key=artifact_key(name, "summary"),
                description=f"Summary of {name}",
            ),
        )

    def checkpoint_rows(self, checkpoints: list[CheckpointInfo]) -> list[dict]:
        rows = []
        for info in checkpoints[-TABLE_ROWS:]:
            seconds = self.checkpoint_seconds.get(info.name)
            rows.append(
                {
                    "name": info.name,
                    "epoch": info.progress.get("epoch", 0),
                    "step": info.progress.get("step", 0),
                    "samples": info.progress.get("samples_seen", 0),
                    "size_mb": round(info.size_bytes / 1e6, 3),
                    "verified": not self.store.check(info),
                    "seconds_to_save": round(seconds, 3) if seconds is not None else None,
                }
            )
        return rows

    def write_loss_curve(self, checkpoints: list[CheckpointInfo]) -> str | None:
        """Writes ``<run>/loss.svg`` (training loss of each unit against the step) next to the checkpoints."""
        points = [
            (info.progress.get("step", 0), info.manifest.metadata.get("metrics", {}).get("loss"))
            for info in checkpoints
        ]
        points = [(x, y) for x, y in points if isinstance(y, (int, float))]
        if not points:
            return None
        self.store.storage.put(LOSS_CURVE, loss_curve_svg(points, self.config.run_name).encode())
        return self.store.storage.uri(LOSS_CURVE)

    def _quietly(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.log.warning(
                "could not publish the %s artifact of %s: %s: %s", what, self.config.run_name, type(exc).__name__, exc
            )
            return None


def percent_done(config: TrainConfig, progress: dict[str, int], num_train_samples: int | None) -> float:
    """How far training is toward ``max_duration``, in percent."""
    duration = config.duration
    if duration.unit == "ba":
        done = progress.get("step", 0)
    else:
        done = progress.get("epoch", 0)
        if num_train_samples:
            done += progress.get("sample_in_epoch", 0) / num_train_samples
    return round(min(100.0, 100.0 * done / duration.value), 2)


def batch_size_changes(checkpoints: list[CheckpointInfo]) -> list[str]:
    """Each change of global batch size between consecutive checkpoints, as 'old -> new at <name>'."""
    changes, previous = [], None
    for info in checkpoints:
        size = info.manifest.metadata.get("global_batch_size")
        if previous is not None and size != previous:
            changes.append(f"{previous} -> {size} at {info.name}")
        previous = size
    return changes


def unit_retries(run_name: str) -> int | None:
    """Retries of this flow run's units, summed over its task runs (None when the API cannot tell)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    run_id = flow_run.id
    if run_id is None:
        return None
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [UUID(run_id)]}))
    return sum(max(t.run_count - 1, 0) for t in task_runs if t.name.startswith(f"{run_name}-unit-"))


def summary_markdown(
    config: TrainConfig,
    store: CheckpointStore,
    units: list[UnitResult],
    metrics: dict[str, float],
    started_from: str,
    checkpoints: list[CheckpointInfo],
    curve_uri: str | None,
) -> str:
    # "checkpoint <name>" is a resume from the store; "checkpoint <name> (in memory...)" reused this process's state.
    resumed = [u for u in units if u.resumed_from.startswith("checkpoint ") and "(in memory" not in u.resumed_from]
    try:
        retries = unit_retries(config.run_name)
    except Exception:
        retries = None
    changes = batch_size_changes(checkpoints)
    lines = [
        f"# Run `{config.run_name}`",
        "",
        f"- store: `{store.uri}`",
        f"- recipe: `{config.recipe}`, max_duration {config.max_duration}, save_interval {config.save_interval}, "
        f"global_batch_size {config.global_batch_size}",
        f"- this flow run started from: {started_from}; flow-run restarts so far: {(flow_run.run_count or 1) - 1}",
        f"- units trained in this flow run: {len(units)}; resumed from a stored checkpoint: {len(resumed)}",
        f"- unit retries: {'unknown' if retries is None else retries}",
        f"- global batch size changes: {'; '.join(changes) if changes else 'none'}",
        f"- checkpoints: {len(checkpoints)}; last: `{checkpoints[-1].uri if checkpoints else '-'}`",
        "",
        "| metric | value |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {value:.4f} |" for name, value in metrics.items()] or ["| (no eval split) | |"]
    if curve_uri:
        link = f"file://{curve_uri}" if curve_uri.startswith("/") else curve_uri
        lines += ["", f"Training loss per unit: [{LOSS_CURVE}]({link})"]
    return "\n".join(lines)


def loss_curve_svg(points: list[tuple[int, float]], title: str, width: int = 480, height: int = 260) -> str:
    """A line chart of (step, loss) as a standalone SVG (no plotting library needed)."""
    left, right, top, bottom = 56, 16, 28, 36
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1e-9

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * (height - top - bottom)

    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5"/>' for x, y in points)
    axis_y = height - bottom
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="{left}" y="16" font-size="13">training loss per unit: {html.escape(title)}</text>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{axis_y}" stroke="black"/>'
        f'<line x1="{left}" y1="{axis_y}" x2="{width - right}" y2="{axis_y}" stroke="black"/>'
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{y1:.3g}</text>'
        f'<text x="{left - 4}" y="{axis_y}" text-anchor="end">{y0:.3g}</text>'
        f'<text x="{left}" y="{axis_y + 14}" text-anchor="middle">{x0}</text>'
        f'<text x="{width - right}" y="{axis_y + 14}" text-anchor="middle">{x1}</text>'
        f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">step</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{path}"/>'
        f'<g fill="#1f77b4">{dots}</g></svg>'
    )
