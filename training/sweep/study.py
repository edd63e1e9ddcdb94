"""The study: a sweep's ledger events folded into trials, the one state every scheduler decision reads.

The ledger (``checkpointing/ledger.py``) stores events generically; here they get their meaning. ``Study.fold``
replays them in ``seq`` order, so a relaunched sweep sees what the killed one recorded, and ``apply`` is the same
step for one decision, so a scheduler can look at the study its decisions make before the flow records them.
``summary()`` keeps what the decisions made (trials, parameters, units, lineage, states) and drops what depends on
timing (seqs, times, the order trials finished), so two sweeps that decided alike compare equal.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

State = Literal["pending", "running", "paused", "stopped", "completed", "failed"]
ENDED = ("stopped", "completed", "failed")


class Event(Protocol):
    """What the fold reads of a ledger event (``checkpointing.ledger.Event`` has these, and time and writer)."""

    @property
    def seq(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def body(self) -> dict[str, Any]: ...


@dataclass
class Trial:
    """One trial: its parameters now, its current run, and every unit checkpoint its runs committed."""

    name: str
    index: int
    params: dict[str, Any]
    run_name: str
    state: State = "pending"
    units: list[dict[str, Any]] = field(default_factory=list)  # one per unit number, ascending
    lineage: list[dict[str, Any]] = field(default_factory=list)  # exploit bodies, oldest first
    rung: int = 0  # ASHA: the rung it entered last
    units_trained: int = 0
    started_from: list[str] = field(default_factory=list)
    target_units: int = 0  # of the segment running or last started
    load_path: str | None = None  # where its next segment starts (an exploit's copy), None: the run autoresumes
    paused_at: int | None = None  # ASHA: the rung a trial_paused event last named
    error: str | None = None
    claimed_in: dict[int, int] = field(default_factory=dict)  # unit number -> seq of the event that reported it
    last_seq: int = -1  # of the last event about this trial (the one that set its state)

    @property
    def reached(self) -> int:
        """The newest unit it has a checkpoint of (0: none)."""
        return self.units[-1]["unit"] if self.units else 0

    def unit(self, number: int) -> dict[str, Any] | None:
        return next((u for u in self.units if u["unit"] == number), None)

    def metric(self, number: int, metric: str) -> float | None:
        """The metric at a unit, or None when the unit or the metric is missing (or not a finite number)."""
        found = self.unit(number)
        value = (found or {}).get("metrics", {}).get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return None

    def merge_units(self, units: Iterable[dict[str, Any]], seq: int = -1) -> None:
        """A unit reported again (a later segment of the trial) replaces the earlier entry."""
        by_number = {u["unit"]: u for u in self.units}
        for u in units:
            by_number[int(u["unit"])] = dict(u)
            self.claimed_in[int(u["unit"])] = seq
        self.units = [by_number[n] for n in sorted(by_number)]

    def runs(self) -> list[str]:
        """Every run this trial trained: its own, then one per exploit (``t003-e1``, ...; never another trial's)."""
        own = re.compile(rf"^{re.escape(self.name)}-e[0-9]{{1,6}}$")
        return [self.name, *(str(e.get("run_name")) for e in self.lineage if own.match(str(e.get("run_name"))))]

    def keep_units(self, verified: list[dict[str, Any]], total: int) -> None:
        """Only ``verified`` units count (the ledger claimed more): a trial whose state rests on units it does not
        have is pending again, and its run resumes from its newest checkpoint (an exploit's run with none starts
        from its copy again). ``total``: the units of the whole budget, which a completed trial has."""
        self.units = sorted(verified, key=lambda u: u["unit"])
        needs = total if self.state == "completed" else self.target_units if self.state == "paused" else 0
        if self.reached < needs:
            self.state = "pending"
            self.paused_at = None
            if self.lineage and not any(u.get("run_name") == self.run_name for u in self.units):
                self.load_path = self.lineage[-1].get("copy")


@dataclass
class Study:
    """Every trial of a sweep, by name, in index order; and what the sweep's first and last events said."""

    trials: dict[str, Trial] = field(default_factory=dict)
    spec: dict[str, Any] | None = None
    finished: dict[str, Any] | None = None
    last_seq: int = -1

    @classmethod
    def fold(cls, events: Iterable[Event]) -> Study:
        """The study the events make, replayed in ``seq`` order."""
        study = cls()
        for event in sorted(events, key=lambda e: e.seq):
            study.apply(event.kind, event.body, event.seq)
            study.last_seq = event.seq
        return study

    def copy(self) -> Study:
        return copy.deepcopy(self)

    def apply(self, kind: str, body: dict[str, Any], seq: int = -1) -> None:
        """One event's change (``seq``: its number); an unknown kind changes nothing (a newer writer's extra events)."""
        if kind == "sweep_started":
            self.spec = body.get("spec")
        elif kind == "sweep_finished":
            self.finished = dict(body)
        elif kind == "trial_created":
            name = body["trial"]
            self.trials[name] = Trial(name, int(body["index"]), dict(body["params"]), run_name=name)
        elif kind == "segment_finished":
            _segment_finished(self.trials[body["trial"]], body, seq)
        elif kind in _TRIAL_EVENTS:
            _TRIAL_EVENTS[kind](self.trials[body["trial"]], body)
        if kind in _TRIAL_EVENTS or kind == "segment_finished":
            self.trials[body["trial"]].last_seq = seq

    def by_index(self) -> list[Trial]:
        return sorted(self.trials.values(), key=lambda t: t.index)

    def running(self) -> list[Trial]:
        return [t for t in self.by_index() if t.state == "running"]

    def best(self, metric: str, mode: str) -> tuple[Trial, dict[str, Any]] | None:
        """The best unit checkpoint of any trial by ``metric`` (``mode`` 'min' or 'max'); ties: trial index, unit."""
        found = None
        for trial in self.by_index():
            for unit in trial.units:
                value = trial.metric(unit["unit"], metric)
                if value is None:
                    continue
                key = (value if mode == "min" else -value, trial.index, unit["unit"])
                if found is None or key < found[0]:
                    found = (key, trial, unit)
        return None if found is None else (found[1], found[2])

    def summary(self) -> dict[str, Any]:
        """What the sweep decided (JSON): equal for two sweeps that decided alike, whatever order trials finished (the
        units' metrics without those that measure time)."""
        return {
            "trials": [
                {
                    "trial": t.name,
                    "index": t.index,
                    "params": t.params,
                    "run_name": t.run_name,
                    "state": t.state,
                    "rung": t.rung,
                    "units": [_without_timings(u) for u in t.units],
                    "lineage": t.lineage,
                }
                for t in self.by_index()
            ],
            "finished": self.finished,
        }


# A unit's metrics that measure time, not training: they differ between two runs of the same unit.
TIMINGS = frozenset(
    {
        "train_seconds",
        "samples_per_second",
        "snapshot_seconds_max",
        "checkpoint_seconds",
        "snapshot_copy_seconds_max",
        "snapshot_wait_seconds_max",
    }
)


def _without_timings(unit: dict[str, Any]) -> dict[str, Any]:
    metrics = unit.get("metrics")
    if not isinstance(metrics, dict):
        return unit
    return {**unit, "metrics": {k: v for k, v in metrics.items() if k not in TIMINGS}}


def _segment_started(trial: Trial, body: dict[str, Any]) -> None:
    trial.state = "running"
    trial.run_name = body["run_name"]
    trial.target_units = int(body["target_units"])
    trial.load_path = body.get("load_path")


def _segment_finished(trial: Trial, body: dict[str, Any], seq: int = -1) -> None:
    trial.merge_units(({"run_name": body["run_name"], **u} for u in body.get("units") or []), seq)
    trial.units_trained += int(body.get("units_trained") or 0)
    if body.get("started_from"):
        trial.started_from.append(body["started_from"])
    if body.get("status") != "ok":
        trial.state, trial.error = "failed", body.get("error") or "the segment failed"
    elif trial.reached < int(body["target_units"]):
        trial.state = "failed"
        trial.error = f"the run {body['run_name']} ended at unit {trial.reached}, before unit {body['target_units']}"
    else:
        trial.state = "paused"  # until the scheduler decides
        trial.load_path = None  # the run has checkpoints now: it autoresumes


def _paused(trial: Trial, body: dict[str, Any]) -> None:
    trial.state, trial.rung = "paused", int(body["rung"])
    trial.paused_at = trial.rung


def _promoted(trial: Trial, body: dict[str, Any]) -> None:
    trial.state, trial.rung = "pending", int(body["rung"])


def _stopped(trial: Trial, body: dict[str, Any]) -> None:
    trial.state = "stopped"


def _completed(trial: Trial, body: dict[str, Any]) -> None:
    trial.state = "completed"


def _exploit(trial: Trial, body: dict[str, Any]) -> None:
    trial.lineage.append(dict(body))
    trial.params = dict(body["params_after"])
    trial.run_name = body["run_name"]
    trial.load_path = body.get("copy")
    trial.state = "pending"


_TRIAL_EVENTS = {
    "segment_started": _segment_started,
    "trial_paused": _paused,
    "trial_promoted": _promoted,
    "trial_stopped": _stopped,
    "trial_completed": _completed,
    "exploit": _exploit,
}
