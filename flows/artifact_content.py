"""What a run's artifacts say, as plain rows and text: the per-unit table, the curves, progress and ETA.

No Prefect here, so all of it is tested without a server; ``flows/artifacts.py`` publishes it.

Escaping. Prefect 3.8's UI renders markdown artifacts, artifact descriptions and *table cells* as markdown,
and its sanitizer lets some raw HTML through (an ``<img>`` with any ``src``, ``javascript:`` links in table
cells were seen rendered). Names that reach it come from a run's parameters, a recipe (metric names) or a
bucket (checkpoint names in manifests), so every such string goes through ``md_escape`` (a backslash before
each ASCII punctuation character, which CommonMark shows literally; HTML entities would be shown as typed),
``md_code`` (a code span, also shown literally) or ``safe_column`` (table headers). In table cells, names
that already follow the store's name rule pass unchanged.
"""

from __future__ import annotations

import base64
import html
import math
import re
from typing import Any

LOSS = "train_loss"
OLD_LOSS = "loss"  # the training loss's name in checkpoints written before 0.2
EVAL_PREFIX = "eval_"  # per-unit evaluation metrics in UnitResult.metrics, rendered whatever their names
MAX_POINTS = 400  # per curve: a long run's SVG stays a few tens of KB
SPARK = "▁▂▃▄▅▆▇█"

_PUNCT = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation character
_ESCAPED = re.compile(r"\\([!-/:-@\[-`{-~])")
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the checkpoint store's own name rule
_COLUMN = re.compile(r"[^A-Za-z0-9_.-]")

# The per-unit table, in column order; eval metrics go between "train_loss" and "samples/s".
BEFORE_EVAL = ["unit", "epoch", "step", "samples", "train_loss"]
AFTER_EVAL = ["samples/s", "checkpoint s", "attempt", "resumed from", "checkpoint"]


# -- escaping -------------------------------------------------------------------------------------
def md_escape(text: Any) -> str:
    """``text`` as literal markdown: one line, every punctuation character backslash-escaped."""
    return _PUNCT.sub(r"\\\1", " ".join(str(text).split()))


def md_code(text: Any) -> str:
    """``text`` as a markdown code span (shown literally, in monospace): fenced with more backticks than
    it holds. Not for table cells, where a '|' would still split the cell: use ``md_escape`` there."""
    flat = " ".join(str(text).split())
    if not flat:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat[0] == "`" or flat[-1] == "`" else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def md_unescape(text: str) -> str:
    return _ESCAPED.sub(r"\1", text)


def cell(text: Any) -> str:
    """A string for a table cell (rendered as markdown): plain names as they are, anything else escaped."""
    text = str(text)
    return text if _PLAIN.match(text) else md_escape(text)


def safe_column(name: str) -> str:
    """A metric name as a table header: letters, digits, '_', '.', '-' only."""
    return _COLUMN.sub("_", str(name))[:40] or "_"


# -- rows: one per unit -----------------------------------------------------------------------------
def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _round(value: Any, digits: int) -> float | None:
    number = _number(value)
    return None if number is None else round(number, digits)


def eval_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The ``eval_*`` metrics, named as their table column will be."""
    return {safe_column(k): v for k, v in metrics.items() if str(k).startswith(EVAL_PREFIX) and _number(v) is not None}


def unit_row(result: Any, attempt: int | None) -> dict[str, Any]:
    """The row of a UnitResult (read with .get: fields may be added)."""
    metrics = dict(result.metrics or {})
    return {
        **_row(result.unit, result.checkpoint_name, dict(result.progress or {}), metrics),
        "checkpoint_seconds": _number(metrics.get("checkpoint_seconds")),
        "resumed_from": getattr(result, "resumed_from", None),
        "attempt": attempt,
    }


def manifest_row(info: Any, unit: int | None) -> dict[str, Any]:
    """The row of a committed checkpoint trained before this flow run attempt (its manifest's metrics)."""
    metrics = dict(info.manifest.metadata.get("metrics") or {})
    return {
        **_row(unit, info.name, dict(info.progress or {}), metrics),
        "checkpoint_seconds": None,  # measured after the manifest was written: only the unit's result has it
        "resumed_from": None,
        "attempt": None,
    }


def _row(unit: int | None, checkpoint: str, progress: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """The columns that a unit's result and a checkpoint's manifest both fill."""
    return {
        "unit": unit,
        "checkpoint": checkpoint,
        "epoch": progress.get("epoch"),
        "step": progress.get("step"),
        "samples": progress.get("samples_seen"),
        "train_loss": _number(metrics.get(LOSS, metrics.get(OLD_LOSS))),
        "eval": eval_metrics(metrics),
        "samples_per_second": _number(metrics.get("samples_per_second")),
    }


def sorted_rows(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows.values(), key=lambda r: (r.get("samples") or 0, r.get("step") or 0))


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table artifact's rows: fixed columns, then every eval metric any row has (empty where a unit has none)."""
    names = sorted({name for row in rows for name in row.get("eval", {})})
    out = []
    for row in rows:
        line: dict[str, Any] = {
            "unit": row.get("unit"),
            "epoch": row.get("epoch"),
            "step": row.get("step"),
            "samples": row.get("samples"),
            "train_loss": _round(row.get("train_loss"), 4),
        }
        line.update({n: _round(row.get("eval", {}).get(n), 4) for n in names})
        line["samples/s"] = _round(row.get("samples_per_second"), 1)
        line["checkpoint s"] = _round(row.get("checkpoint_seconds"), 3)
        line["attempt"] = row.get("attempt")  # of the flow run: > 1 after a crash-restart
        line["resumed from"] = cell(row["resumed_from"]) if row.get("resumed_from") else None
        line["checkpoint"] = cell(row.get("checkpoint", ""))
        out.append(line)
    return out


def row_from_table(line: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``table`` for one row: how a restarted flow run takes over its killed attempt's rows."""
    fixed = set(BEFORE_EVAL) | set(AFTER_EVAL)
    return {
        "unit": line.get("unit"),
        "checkpoint": md_unescape(str(line.get("checkpoint") or "")),
        "epoch": line.get("epoch"),
        "step": line.get("step"),
        "samples": line.get("samples"),
        "train_loss": _number(line.get("train_loss", line.get(OLD_LOSS))),
        "eval": {k: v for k, v in line.items() if k not in fixed and _number(v) is not None},
        "samples_per_second": _number(line.get("samples/s")),
        "checkpoint_seconds": _number(line.get("checkpoint s")),
        "resumed_from": md_unescape(line["resumed from"]) if line.get("resumed from") else None,
        "attempt": line.get("attempt"),
    }


# -- curves ---------------------------------------------------------------------------------------
def curves(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per unit: the training loss, then each eval metric, in that order."""
    series: dict[str, list[tuple[int, float]]] = {LOSS: []}
    for row in rows:
        step = row.get("step") or 0
        if row.get("train_loss") is not None:
            series[LOSS].append((step, row["train_loss"]))
        for name, value in sorted(row.get("eval", {}).items()):
            series.setdefault(name, []).append((step, value))
    return {name: points for name, points in series.items() if points}


def thinned(points: list, limit: int = MAX_POINTS) -> list:
    """At most ``limit`` points, evenly spread, always keeping the first and the last."""
    if len(points) <= limit:
        return points
    stride = (len(points) - 1) / (limit - 1)
    return [points[round(i * stride)] for i in range(limit)]


def sparkline(values: list[float], width: int = 24) -> str:
    values = thinned(values, width)
    if not values:
        return ""
    low, high = min(values), max(values)
    scale = (len(SPARK) - 1) / (high - low) if high > low else 0
    return "".join(SPARK[round((v - low) * scale)] for v in values)


def curve_svg(
    series: dict[str, list[tuple[int, float]]], title: str, width: int = 560, panel: int = 150, x_label: str = "step"
) -> str:
    """One panel per series (own y scale: a loss and an accuracy do not share an axis), ``x_label`` (step) on x."""
    parts = [
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="8" y="18" font-size="13">{html.escape(title)}</text>',
    ]
    for i, (name, points) in enumerate(series.items()):
        parts.append(_panel(name, thinned(points), top=28 + i * panel, width=width, height=panel, x_label=x_label))
    height = 28 + panel * max(len(series), 1)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">{"".join(parts)}</svg>'
    )


def log_axis(ys: list[float]) -> bool:
    """A log y axis for positive values spanning more than a factor of 10 (on a linear one everything after the
    first drop is a flat line at the bottom)."""
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 10


def _panel(name: str, points: list[tuple[int, float]], top: int, width: int, height: int, x_label: str) -> str:
    left, right, bottom = 64, 16, top + height - 30
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1e-9
    plot_top = top + 20
    log = log_axis(ys)  # a loss falling over orders of magnitude stays readable after the first units
    f = math.log10 if log else float
    f0, f1 = f(y0), f(y1) if f(y1) > f(y0) else f(y0) + 1e-9

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return plot_top + (f1 - f(y)) / (f1 - f0) * (bottom - plot_top)

    color = "#1f77b4" if name == LOSS else "#d62728"
    label = "training loss" if name == LOSS else name
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5"/>' for x, y in points[-60:])
    return (
        f'<text x="{left}" y="{top + 14}" font-size="12">{html.escape(label)}: {ys[-1]:.4g} at {x_label} {xs[-1]}'
        f"{' (log scale)' if log else ''}</text>"
        f'<line x1="{left}" y1="{plot_top}" x2="{left}" y2="{bottom}" stroke="black"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{width - right}" y2="{bottom}" stroke="black"/>'
        f'<text x="{left - 4}" y="{plot_top + 4}" text-anchor="end">{y1:.3g}</text>'
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{y0:.3g}</text>'
        f'<text x="{left}" y="{bottom + 14}" text-anchor="middle">{x0}</text>'
        f'<text x="{width - right}" y="{bottom + 14}" text-anchor="end">{x_label} {x1}</text>'
        f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>'
        f'<g fill="{color}">{dots}</g>'
    )


def svg_image(svg: str, alt: str) -> str:
    """Markdown for an inline image. Prefect's UI shows a data: URI image (an http one would have to be
    public; file:// and s3:// links are refused); an SVG in an <img> runs no script."""
    return f"![{md_escape(alt)}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def curve_summary(series: dict[str, list[tuple[int, float]]]) -> str:
    """One markdown line per curve: a sparkline, first and last value."""
    lines = []
    for name, points in series.items():
        values = [v for _, v in points]
        label = "training loss" if name == LOSS else md_escape(name)
        lines.append(
            f"- {label}: {sparkline(values)} {values[0]:.4g} → {values[-1]:.4g} "
            f"({plural(len(values), 'unit')}, last at step {points[-1][0]})"
        )
    return "\n".join(lines)


# -- progress -------------------------------------------------------------------------------------
def total_samples(duration: Any, progress: dict[str, int], num_train_samples: int | None, batch: int) -> int | None:
    """Samples the whole run trains (None while it cannot be known: epochs before the dataset size is)."""
    if duration.unit == "ep":
        return duration.value * num_train_samples if num_train_samples else None
    if duration.unit == "ba":  # the step counter continues at samples_seen // batch after a resize
        return progress.get("samples_seen", 0) + max(duration.value - progress.get("step", 0), 0) * batch
    if duration.unit == "sp":
        return duration.value
    return None


def duration_text(seconds: float) -> str:
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def progress_text(done: int, total: int | None, rate: float | None, attempt: int) -> str:
    """The progress card's description: samples done / total, the ETA at this attempt's pace."""
    parts = [f"{done:,} / {total:,} samples" if total else f"{done:,} samples (total known after the first unit)"]
    if total and rate and rate > 0:
        parts.append(f"ETA {duration_text(max(total - done, 0) / rate)} at {rate:,.0f} samples/s")
    if attempt > 1:
        parts.append(f"flow run attempt {attempt} (restarted {attempt - 1}×)")
    return " · ".join(parts)
