"""The sweep's schedulers decide from the study alone: a simulated sweep with a fake trainer, finished in many random
orders, killed and relaunched, makes the same decisions every time; ASHA trains no more than its rung budget and
resumes paused trials from their rung; PBT's weak trials exploit strong ones with the lineage recorded."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest

from training.config import TrainConfig
from training.sweep import Job, Study, SweepConfig, plan, rungs, unfinished_segments


@dataclass(frozen=True)
class Ev:
    seq: int
    kind: str
    body: dict[str, Any]


def sweep_config(scheduler: str, **overrides: Any) -> SweepConfig:
    values: dict[str, Any] = {
        "train": TrainConfig(save_folder="memory://sweeps", max_duration="8ba", save_interval="1ba"),
        "sweep_name": "s",
        "space": {"recipe_args.lr": {"loguniform": [1e-4, 1e-1]}, "recipe_args.width": {"grid": [1, 2]}},
        "num_samples": 4,
        "scheduler": scheduler,
        "search_seed": 3,
        "metric": "loss",  # what FakeTrainer reports
    }
    return SweepConfig(**(values | overrides))


class FakeTrainer:
    """Runs in a store of its own: 'weights' grow each unit by a gain that depends on the parameters."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[int, float]] = {}  # run name -> unit -> weights
        self.files: dict[str, float] = {}  # checkpoint uri -> weights
        self.units_trained = 0

    @staticmethod
    def gain(params: dict[str, Any]) -> float:
        return params["recipe_args.width"] / (1 + abs(math.log10(params["recipe_args.lr"]) + 2.5))

    def train(self, job: Job, upto: int) -> tuple[int, str]:
        """Trains ``job``'s run up to unit ``upto``, resuming its newest checkpoint: (units trained, started from)."""
        run = self.runs.setdefault(job.run_name, {})
        if run:
            start, weights, started = max(run), run[max(run)], f"memory://sweeps/s/{job.run_name}/u{max(run)}"
        elif job.load_path:
            weights, started = self.files[job.load_path], job.load_path
            start = int(job.load_path.rsplit("u", 1)[1])
        else:
            start, weights, started = 0, 0.0, "fresh"
        for unit in range(start + 1, upto + 1):
            weights += self.gain(job.params)
            run[unit] = weights
            self.files[f"memory://sweeps/s/{job.run_name}/u{unit}"] = weights
        self.units_trained += max(0, upto - start)
        return max(0, upto - start), started

    def finish(self, job: Job) -> dict[str, Any]:
        trained, started = self.train(job, job.target_units)
        units = [
            {"unit": u, "step": u, "samples_seen": 64 * u, "metrics": {"loss": 1 / (1 + w)},
             "checkpoint": f"memory://sweeps/s/{job.run_name}/u{u}"}
            for u, w in sorted(self.runs[job.run_name].items()) if u <= job.target_units
        ]  # fmt: skip
        return {"trial": job.trial, "run_name": job.run_name, "target_units": job.target_units, "status": "ok",
                "units": units, "units_trained": trained, "started_from": started}  # fmt: skip


class Sweep:
    """The flow's loop, with the finishing order drawn at random and a kill after any number of events."""

    def __init__(self, config: SweepConfig, trainer: FakeTrainer | None = None) -> None:
        self.config, self.trainer = config, trainer or FakeTrainer()
        self.events: list[Ev] = []

    def record(self, kind: str, body: dict[str, Any]) -> None:
        self.events.append(Ev(len(self.events), kind, body))

    def run(self, rng: random.Random, slots: int, kill_after: int | None = None) -> Study:
        study = Study.fold(self.events)
        running = {job.trial: job for job in unfinished_segments(study)}
        while kill_after is None or len(self.events) < kill_after:
            step = plan(study, self.config)
            for kind, body in step.decisions:
                if kind == "exploit":
                    body = body | {"copy": f"memory://sweeps/s/sweep/exploits/{body['run_name']}/u{body['unit']}"}
                    self.trainer.files[body["copy"]] = self.trainer.files[body["donor_checkpoint"]]
                self.record(kind, body)
            study = Study.fold(self.events)
            if any(kind == "exploit" for kind, _ in step.decisions):
                continue
            for job in step.jobs[: slots - len(running)]:
                self.record("segment_started", {"trial": job.trial, "run_name": job.run_name,
                            "target_units": job.target_units, "load_path": job.load_path, "params": job.params})  # fmt: skip
                running[job.trial] = job
            study = Study.fold(self.events)
            if step.done:
                return study
            assert running, f"nothing runs and the sweep is not done: {step}"
            job = running.pop(rng.choice(sorted(running)))
            self.record("segment_finished", self.trainer.finish(job))
            study = Study.fold(self.events)
        for job in running.values():  # killed mid-segment: each run got some way
            self.trainer.train(job, rng.randint(0, job.target_units))
        return study


def uninterrupted(config: SweepConfig, seed: int, slots: int) -> tuple[Study, Sweep]:
    sweep = Sweep(config)
    return sweep.run(random.Random(seed), slots), sweep


def test_fifo_trains_every_trial_its_whole_budget_once() -> None:
    study, sweep = uninterrupted(sweep_config("fifo"), seed=0, slots=3)
    assert [t.state for t in study.by_index()] == ["completed"] * 8
    assert [t.reached for t in study.by_index()] == [8] * 8
    assert sweep.trainer.units_trained == 64
    best = study.best("loss", "min")
    assert study.finished is not None and best is not None and study.finished["best_trial"] == best[0].name


def test_the_first_plan_creates_every_trial_and_starts_them_in_index_order() -> None:
    config = sweep_config("fifo")
    first = plan(Study(), config)
    kinds = [kind for kind, _ in first.decisions]
    assert kinds == ["sweep_started"] + ["trial_created"] * 8
    assert [job.run_name for job in first.jobs] == [f"t00{i}" for i in range(8)]
    assert first.decisions[0][1]["spec"] == config.spec() and not first.done


def test_a_running_segment_is_not_planned_again_but_restarted_by_a_relaunch() -> None:
    sweep = Sweep(sweep_config("fifo"))
    study = sweep.run(random.Random(0), slots=2, kill_after=12)
    assert {job.trial for job in unfinished_segments(study)} == {t.name for t in study.running()}
    assert not {job.trial for job in plan(study, sweep.config).jobs} & {t.name for t in study.running()}


@pytest.mark.parametrize("scheduler", ["fifo", "asha", "pbt"])
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_any_finish_order_makes_the_same_sweep(scheduler: str, slots: int) -> None:
    config = sweep_config(scheduler)
    reference = uninterrupted(config, seed=0, slots=1)[0].summary()
    for seed in range(12):
        assert uninterrupted(config, seed=seed, slots=slots)[0].summary() == reference


@pytest.mark.parametrize("scheduler", ["fifo", "asha", "pbt"])
def test_a_sweep_killed_and_relaunched_at_random_moments_makes_the_same_sweep_and_retrains_nothing(
    scheduler: str,
) -> None:
    config = sweep_config(scheduler)
    reference, clean = uninterrupted(config, seed=0, slots=2)
    for seed in range(8):
        rng, sweep = random.Random(seed), Sweep(config)
        for _ in range(5):
            sweep.run(rng, slots=rng.randint(1, 4), kill_after=len(sweep.events) + rng.randint(1, 15))
        study = sweep.run(rng, slots=2)
        assert study.summary() == reference.summary()
        assert sweep.trainer.units_trained == clean.trainer.units_trained
        assert sum(t.units_trained for t in study.trials.values()) <= clean.trainer.units_trained


def test_asha_rungs_grow_by_the_reduction_factor_and_end_at_the_budget() -> None:
    assert rungs(sweep_config("asha")) == [1, 2, 4, 8]
    assert rungs(sweep_config("asha", grace_period=3, reduction_factor=3)) == [3, 8]
    assert rungs(sweep_config("asha", grace_period=8)) == [8]


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_asha_trains_exactly_its_rung_budget_and_stops_the_rest(slots: int) -> None:
    config = sweep_config("asha", num_samples=8)  # 16 trials
    study, sweep = uninterrupted(config, seed=slots, slots=slots)
    milestones = rungs(config)
    budget = sum(milestones[t.rung] for t in study.trials.values())
    assert sweep.trainer.units_trained == budget <= 1.05 * budget
    assert sum(t.units_trained for t in study.trials.values()) == budget
    states = [t.state for t in study.by_index()]
    assert set(states) == {"completed", "stopped"} and states.count("completed") >= 1
    assert sum(1 for t in study.trials.values() if t.rung >= 1) >= 16 // 2
    assert budget < 16 * 8 / 2


def test_a_promoted_asha_trial_resumes_its_own_run_from_its_rung() -> None:
    sweep = Sweep(sweep_config("asha"))
    sweep.run(random.Random(1), slots=2)
    promoted = [e for e in sweep.events if e.kind == "trial_promoted"]
    assert promoted
    for event in promoted:
        trial, rung = event.body["trial"], event.body["rung"]
        later = [e for e in sweep.events[event.seq :] if e.kind == "segment_started" and e.body["trial"] == trial]
        assert later[0].body["run_name"] == trial and later[0].body["load_path"] is None
        assert later[0].body["target_units"] == rungs(sweep.config)[rung]
        before = Study.fold(sweep.events[: event.seq])
        assert later[0].body["target_units"] > before.trials[trial].reached == rungs(sweep.config)[rung - 1]
    started = [e.body["started_from"] for e in sweep.events if e.kind == "segment_finished"]
    assert started.count("fresh") == 8  # one fresh start per trial, every other segment resumed


def test_pbt_bottom_trials_exploit_top_ones_with_the_lineage_recorded() -> None:
    config = sweep_config("pbt", perturbation_interval=2)
    study, sweep = uninterrupted(config, seed=0, slots=3)
    exploits = [e.body for e in sweep.events if e.kind == "exploit"]
    assert len(exploits) == 3 * 2  # 3 generations before the budget, ceil(8 * 0.25) = 2 trials each
    for body in exploits:
        ranked = sorted(study.by_index(), key=lambda t: (t.metric(body["unit"], "loss"), t.index))
        assert body["donor"] in {t.name for t in ranked[:2]} and body["trial"] in {t.name for t in ranked[-2:]}
        trial = study.trials[body["trial"]]
        assert body in trial.lineage and body["run_name"].startswith(f"{body['trial']}-e")
        assert body["donor_checkpoint"] == (study.trials[body["donor"]].unit(body["unit"]) or {})["checkpoint"]
        first = next(e for e in sweep.events if e.kind == "segment_started" and e.body["run_name"] == body["run_name"])
        assert first.body["load_path"] == body["copy"] and first.body["params"] == body["params_after"]
    assert all(t.state == "completed" and t.reached == 8 for t in study.trials.values())


def test_the_best_trial_is_the_best_unit_of_any_trial_ties_by_index_then_unit() -> None:
    study = Study.fold([
        Ev(0, "trial_created", {"trial": "t000", "index": 0, "params": {}}),
        Ev(1, "trial_created", {"trial": "t001", "index": 1, "params": {}}),
        Ev(2, "segment_started", {"trial": "t001", "run_name": "t001", "target_units": 2, "load_path": None}),
        Ev(3, "segment_finished", {"trial": "t001", "run_name": "t001", "target_units": 2, "status": "ok",
           "units": [{"unit": 1, "metrics": {"acc": 0.9}}, {"unit": 2, "metrics": {"acc": 0.9}}]}),
        Ev(4, "segment_started", {"trial": "t000", "run_name": "t000", "target_units": 2, "load_path": None}),
        Ev(5, "segment_finished", {"trial": "t000", "run_name": "t000", "target_units": 2, "status": "ok",
           "units": [{"unit": 1, "metrics": {"acc": 0.5}}, {"unit": 2, "metrics": {"acc": 0.9, "x": 1}}]}),
    ])  # fmt: skip
    trial, unit = study.best("acc", "max")  # type: ignore[misc]
    assert (trial.name, unit["unit"]) == ("t000", 2)
    trial, unit = study.best("acc", "min")  # type: ignore[misc]
    assert (trial.name, unit["unit"]) == ("t000", 1)
    assert study.best("missing", "min") is None


def test_a_unit_reported_again_replaces_the_earlier_one_and_a_failed_segment_fails_the_trial() -> None:
    study = Study.fold([
        Ev(0, "trial_created", {"trial": "t000", "index": 0, "params": {}}),
        Ev(1, "segment_finished", {"trial": "t000", "run_name": "t000", "target_units": 1, "status": "ok",
           "units": [{"unit": 1, "metrics": {"loss": 2.0}}]}),
        Ev(2, "segment_finished", {"trial": "t000", "run_name": "t000", "target_units": 2, "status": "ok",
           "units": [{"unit": 1, "metrics": {"loss": 1.0}}, {"unit": 2, "metrics": {"loss": 0.5}}]}),
        Ev(3, "segment_finished", {"trial": "t000", "run_name": "t000", "target_units": 4, "status": "failed",
           "error": "boom", "units": []}),
    ])  # fmt: skip
    trial = study.trials["t000"]
    assert [(u["unit"], u["metrics"]["loss"]) for u in trial.units] == [(1, 1.0), (2, 0.5)]
    assert trial.state == "failed" and trial.error == "boom"


def test_a_missing_metric_ranks_last_and_is_reported_as_a_warning() -> None:
    config = sweep_config("asha", metric="accuracy", mode="max")
    study = Study.fold(uninterrupted(sweep_config("asha"), seed=0, slots=1)[1].events[:60])
    assert any("no finite 'accuracy'" in w for w in plan(study, config).warnings)


class FailingTrainer(FakeTrainer):
    """Every segment of t002 dies for good (its retries spent)."""

    def finish(self, job: Job) -> dict[str, Any]:
        if job.trial != "t002":
            return super().finish(job)
        return {"trial": job.trial, "run_name": job.run_name, "target_units": job.target_units, "status": "failed",
                "error": "RuntimeError: boom", "units": []}  # fmt: skip


@pytest.mark.parametrize("scheduler", ["fifo", "asha", "pbt"])
def test_a_trial_that_fails_for_good_ranks_last_and_the_sweep_still_finishes(scheduler: str) -> None:
    config = sweep_config(scheduler)
    summaries = []
    for seed in range(4):
        sweep = Sweep(config, FailingTrainer())
        study = sweep.run(random.Random(seed), slots=3)
        assert study.trials["t002"].state == "failed" and study.finished is not None
        assert study.finished["best_trial"] != "t002"
        assert all(t.state in ("completed", "stopped") for n, t in study.trials.items() if n != "t002")
        summaries.append(study.summary())
    assert all(s == summaries[0] for s in summaries)
