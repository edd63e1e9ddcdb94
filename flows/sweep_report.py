"""What a sweep shows: its result, the line at the terminal, and its cards in the Prefect UI.

The cards are a table of trials (parameters, state, units, the metric, the run) and the metric's curve of each trial,
rebuilt from the study (training/sweep/study.py) after every segment: a relaunched sweep shows the same cards.
Each trial is an ordinary training flow run too, with its own cards (flows/artifacts.py).
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.runtime import flow_run
from pydantic import BaseModel

from flows import cli
from flows.artifact_content import cell, curve_svg, md_escape, sparkline, svg_image
from flows.artifacts import Card, artifact_key, unit_of
from tasks.trial import SegmentOutcome
from training.config import TrainConfig
from training.sweep import Study, SweepConfig

logger = logging.getLogger("flows.sweep")


class TrialSummary(BaseModel):
    """One trial, as the result carries it."""

    trial: str
    run_name: str
    state: str
    params: dict[str, Any]
    units: int
    value: float | None  # the sweep's metric at the trial's last unit
    checkpoint: str | None
    lineage: list[dict[str, Any]] = []


class SweepResult(BaseModel):
    """What a sweep reports: the best trial and its checkpoint, every trial, and where the ledger is."""

    sweep_name: str
    folder: str
    ledger: str
    metric: str
    mode: str
    best_trial: str | None
    best_params: dict[str, Any]
    best_checkpoint: str | None
    best_value: float | None
    trials: list[TrialSummary]
    units_trained: int
    summary: dict[str, Any]  # the study's summary: equal for two sweeps that made the same decisions


def sweep_artifact_key(sweep_name: str, what: str) -> str:
    """``sweep-<name>-<what>``: Prefect's artifact keys take lowercase letters, digits and dashes only."""
    return "sweep-" + artifact_key(sweep_name, what).removeprefix("train-")


class SweepReport:
    """The cards of one flow run of ``sweep``, and the figures of its result."""

    def __init__(self, config: SweepConfig, folder: str):
        self.config, self.folder = config, folder
        self.table = Card(sweep_artifact_key(config.sweep_name, "trials"), "table")
        self.curves = Card(sweep_artifact_key(config.sweep_name, "curves"), "markdown")
        self._warned: set[str] = set()

    def warn(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            logger.warning("%s", text)

    def trial_failed(self, trial: str, exc: BaseException) -> None:
        logger.warning("trial %s failed and is left out of the rest of the sweep: %s", trial, exc)

    def stopping(self, forwarded: int) -> None:
        logger.warning("stop requested: asking %d running trial(s) to commit where they stand", forwarded)

    def units_of(self, outcome: SegmentOutcome, config: TrainConfig, target_units: int) -> list[dict[str, Any]]:
        """The segment's unit checkpoints as the ledger keeps them: the unit number (1 = the first), the progress,
        the unit's metrics and the checkpoint, up to the segment's target."""
        units = []
        for c in outcome.checkpoints:
            unit = unit_of(c.progress, config) + 1
            if unit <= target_units:
                units.append(
                    {
                        "unit": unit,
                        "step": c.progress.get("step", 0),
                        "samples_seen": c.progress.get("samples_seen", 0),
                        "metrics": c.metrics,
                        "checkpoint": c.checkpoint,
                    }
                )
        return units

    # -- the UI -------------------------------------------------------------------------------------
    def publish(self, study: Study) -> None:
        """The table of trials and their curves, updated in place (no cards outside a flow run)."""
        if flow_run.id is None:
            return
        try:
            rows = [self._row(s) for s in self.trials(study)]
            self.table.publish(rows, f"Trials of sweep {md_escape(self.config.sweep_name)}")
            self.curves.publish(self._curves(study), f"{self.config.metric} per unit, one curve per trial")
        except Exception as exc:  # the UI is a view: a failing API must not stop the sweep
            self.warn(f"the sweep's cards were not updated: {type(exc).__name__}: {exc}")

    def _row(self, s: TrialSummary) -> dict[str, Any]:
        row: dict[str, Any] = {"trial": s.trial, "state": s.state, "run": s.run_name, "units": s.units}
        row.update({k: float(f"{v:.4g}") if isinstance(v, float) else cell(v) for k, v in s.params.items()})
        row[self.config.metric] = None if s.value is None else round(s.value, 4)
        row["exploits"] = len(s.lineage)
        return row

    def _curves(self, study: Study) -> str:
        series: dict[str, list[tuple[int, float]]] = {}
        for name, trial in sorted(study.trials.items()):
            points = [
                (u["unit"], u["metrics"][self.config.metric]) for u in trial.units if self.config.metric in u["metrics"]
            ]
            if points:
                series[name] = points
        if not series:
            return f"No unit has reported {md_escape(self.config.metric)} yet."
        lines = [
            f"| trial | {md_escape(self.config.metric)} per unit |",
            "|---|---|",
            *(f"| {n} | {sparkline([v for _, v in p])} |" for n, p in series.items()),
        ]
        svg = curve_svg(series, f"sweep {self.config.sweep_name}: {self.config.metric} by unit", x_label="unit")
        return "\n".join([*lines, "", svg_image(svg, f"{self.config.metric} per trial")])

    # -- the result ---------------------------------------------------------------------------------
    def trials(self, study: Study) -> list[TrialSummary]:
        found = []
        for name, trial in sorted(study.trials.items()):
            last = trial.units[-1] if trial.units else None
            found.append(
                TrialSummary(
                    trial=name,
                    run_name=trial.run_name,
                    state=trial.state,
                    params=dict(trial.params),
                    units=last["unit"] if last else 0,
                    value=last["metrics"].get(self.config.metric) if last else None,
                    checkpoint=last["checkpoint"] if last else None,
                    lineage=list(trial.lineage),
                )
            )
        return found

    def result(self, study: Study, ledger: str) -> SweepResult:
        best = study.best(self.config.metric, self.config.mode)
        trial, unit = best if best is not None else (None, None)
        return SweepResult(
            sweep_name=self.config.sweep_name,
            folder=self.folder,
            ledger=ledger,
            metric=self.config.metric,
            mode=self.config.mode,
            best_trial=trial.name if trial is not None else None,
            best_params=dict(trial.params) if trial is not None else {},
            best_checkpoint=unit["checkpoint"] if unit else None,
            best_value=unit["metrics"][self.config.metric] if unit else None,
            trials=self.trials(study),
            units_trained=sum(t.units_trained for t in study.trials.values()),
            summary=study.summary(),
        )


def done_line(result: SweepResult) -> str:
    """The terminal's last line: the trials' ends, the best trial and where to look."""
    states: dict[str, int] = {}
    for t in result.trials:
        states[t.state] = states.get(t.state, 0) + 1
    ends = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    if result.best_trial is None:
        best = f"no trial reported {result.metric}"
    else:
        params = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.best_params.items()
        )
        best = f"best {result.best_trial} ({params}): {result.metric} {result.best_value:.4f}, checkpoint {result.best_checkpoint}"
    return (
        f"sweep {result.sweep_name} complete: {len(result.trials)} trials ({ends}), {result.units_trained} units "
        f"trained; {best}. Trials: {cli.python()} -m checkpointing ls {result.folder}"
    )
