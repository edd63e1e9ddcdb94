"""The summary artifact of a training flow run: how it went (restarts, resumes, retries, batch-size changes),
the final metrics and the curves, in one markdown page.

Every name in it (run, recipe, store URI, metric and checkpoint names) is escaped: the Prefect UI renders
markdown and lets some raw HTML through (see flows/artifact_content.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import UUID

from prefect.runtime import flow_run

from checkpointing import CheckpointInfo, CheckpointStore
from checkpointing.io.redact import redact_uri
from flows import artifact_content as content
from flows.artifact_content import md_code, md_escape
from flows.restarts import flow_run_attempt, restart_count, retries_of
from training.config import TrainConfig
from training.unit.loop import UnitResult


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
    return sum(retries_of(t.run_count) for t in task_runs if t.name.startswith(f"{run_name}-unit-"))


def started_line(started_from: str) -> str:
    """Where this attempt started: a restarted flow run's later attempt usually starts from a checkpoint its
    first attempt wrote, which says nothing about where the flow run itself began."""
    attempt = flow_run_attempt()
    if attempt <= 1:
        return f"this flow run started from: {md_escape(started_from)}"
    return (
        f"this attempt (flow-run attempt {attempt}) started from: {md_escape(started_from)}; the flow run's earlier "
        "attempts are in the per-unit table (its attempt column)"
    )


def wall_time_line() -> str | None:
    """How long the flow run has taken since it first started, across its attempts. Prefect's Duration (the UI's,
    ``total_run_time``) adds up only the stretches the run spent Running: after a crash and restart it leaves out
    the time until the restart ran (crash report, automation, a worker picking the run up, the process starting),
    so a run that took 56 s showed "Duration 33s". None outside a flow run or when the API cannot tell."""
    from prefect.client.orchestration import get_client

    if flow_run.id is None:
        return None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run.id))
    if run.start_time is None:
        return None
    wall = (datetime.now(UTC) - run.start_time).total_seconds()
    line = f"wall time since the flow run first started: {wall:.0f} s ({content.duration_text(wall)})"
    attempt = flow_run_attempt()
    if attempt > 1:
        running = run.estimated_run_time.total_seconds()
        line += (
            f", over {attempt} attempts; Prefect's Duration counts only the time spent Running "
            f"({content.duration_text(running)} so far), not the time between a crash and its restart"
        )
    return line


def summary_markdown(
    config: TrainConfig,
    store: CheckpointStore,
    units: list[UnitResult],
    metrics: dict[str, float],
    started_from: str,
    checkpoints: list[CheckpointInfo],
    curve_uri: str | None,
    series: dict[str, list[tuple[int, float]]],
) -> str:
    resumed = [u for u in units if u.origin == "store"]  # downloaded; "memory" reused this process's state
    try:
        retries = unit_retries(config.run_name)
    except Exception:
        retries = None
    changes = batch_size_changes(checkpoints)
    try:
        wall = wall_time_line()
    except Exception:
        wall = None
    lines = [
        f"# Run {md_code(config.run_name)}",
        "",
        f"- store: {md_code(redact_uri(store.uri))}",  # URIs shown go through redact_uri: no password, no signature
        f"- recipe: {md_code(config.recipe)}, max\\_duration {md_code(config.max_duration)}, "
        f"save\\_interval {md_code(config.save_interval)}, global\\_batch\\_size {config.global_batch_size}",
        f"- {started_line(started_from)}; flow-run restarts so far: {restart_count()}",
        *([f"- {wall}"] if wall else []),
        f"- units trained in this flow run attempt: {len(units)}; resumed from a stored checkpoint: {len(resumed)}",
        f"- unit retries: {'unknown' if retries is None else retries}",
        f"- global batch size changes: {md_escape('; '.join(changes)) if changes else 'none'}",
        f"- checkpoints: {len(checkpoints)}; last: {md_code(redact_uri(checkpoints[-1].uri)) if checkpoints else '-'}",
        "",
        "| metric | value |",
        "| --- | --- |",
    ]
    lines += [f"| {md_escape(name)} | {value:.4f} |" for name, value in metrics.items()] or ["| (no eval split) | |"]
    if series:
        svg = content.curve_svg(series, f"{config.run_name}: per unit")
        lines += ["", "## Per unit", "", content.svg_image(svg, "curves"), "", content.curve_summary(series)]
    if curve_uri:
        lines += ["", f"The same curves as an SVG file in the run folder: {md_code(redact_uri(curve_uri))}"]
    return "\n".join(lines)
