"""The same tiny hyper-parameter search in this product's sweep flow and in Ray Tune (issue 35), side by side.

8 trials of the digits recipe (a grid: 4 learning rates x 2 widths, the same 8 configurations in the same order on
both sides), ASHA with grace_period 1 and reduction_factor 2 over at most 4 units of one epoch, 2 trials at a time,
on the CPU with 1 torch thread per trial. Each side is a whole process, ``python -m bench.sweep_vs_ray --side ours``
or ``--side ray``, timed from outside (imports, Prefect's or Ray's start, the search, shutdown); each reports, from
its own clock, when the best trial's last result was recorded (seconds since the parent started it), the units
(epochs) trained in all, and the best trial's configuration and metric.

* ours: ``flows.sweep.sweep(SweepConfig(...))`` (trials are ordinary runs in the sweep's warm trial processes,
  tasks/trial_runner.py; ASHA pauses a trial at a rung and resumes it from its rung checkpoint); against a running
  Prefect server when PREFECT_API_URL is set, else with what ``sweep()`` starts itself. Times and units are read from
  its ledger's events; a segment's overhead is its wall time (segment_started to segment_finished) minus the
  ``train_seconds`` of the units it trained. The note adds each start-up phase's median over the segments, read from
  their runs' first lines (``start-up ... (reset ..., flow run ..., preflight ...)``, training/start/phases.py).
* ours-fresh: the same, with ``SWEEP_PROCESS_PER_SEGMENT=1``: a fresh ``python -m flows.sweep_trial`` process per
  segment, as before issue 46.
* ray: ``tune.Tuner`` of a function trainable written as Ray's guides write one (the recipe's model, optimizer,
  scheduler and data; one ``tune.report(metrics, checkpoint=...)`` per epoch, ``tune.get_checkpoint()`` on start),
  ``ASHAScheduler``, ``max_concurrent_trials=2``, 1 CPU a trial, ``ray.init(num_cpus=2)``.

Ray is imported only in the ``--side ray`` process (the ``bench`` extra installs it). ``--sides`` picks the sides;
ratios are each side's median over Ray's (and ours over ours-fresh).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, cast

from bench.common import load_average, median, parser, progress, record, rotated, scratch, spread

SPACE: dict[str, list[Any]] = {"recipe_args.lr": [3e-4, 1e-3, 3e-3, 1e-2], "recipe_args.hidden": [32, 128]}
EPOCHS, BATCH, SEED = 4, 32, 0
METRIC, MODE = "eval_loss", "min"
SIDES = ("ours", "ours-fresh", "ray")
MARK = "SWEEP_BENCH_RESULT "  # the line a side prints its figures on (JSON)
STARTUP = re.compile(r"; start-up [\d.]+ s \(([^)]*)\)")  # each segment's run says where its start-up went
T0 = "SWEEP_BENCH_T0"  # the parent's time.time() just before it started the side's process


# -- the search, as plain data (no Ray, no Prefect) ----------------------------------------------
def trial_grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the first key varying slowest (itertools.product's order)."""
    keys = list(space)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(space[k] for k in keys))]


def ray_param_space(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Ray Tune's param_space for exactly these trials, in this order: ``{"params": tune.grid_search(trials)}``
    (``tune.grid_search(v)`` is the plain dict ``{"grid_search": v}``)."""
    return {"params": {"grid_search": [dict(t) for t in trials]}}


def our_space(space: dict[str, list[Any]]) -> dict[str, dict[str, list[Any]]]:
    """The sweep flow's space for the same grid: ``{"recipe_args.lr": {"grid": [...]}, ...}``."""
    return {key: {"grid": list(values)} for key, values in space.items()}


def recipe_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """``{"recipe_args.lr": 0.01}`` -> ``{"lr": 0.01}``: the recipe's constructor arguments of one trial."""
    out = {}
    for key, value in params.items():
        prefix, _, name = key.partition(".")
        if prefix != "recipe_args" or not name:
            raise ValueError(f"trial parameter {key!r}: this benchmark searches recipe_args.<name> only")
        out[name] = value
    return out


def short(params: dict[str, Any]) -> str:
    return ", ".join(f"{k.removeprefix('recipe_args.')}={v:g}" for k, v in sorted(params.items()))


RATIOS = (("ours", "ray"), ("ours-fresh", "ray"), ("ours", "ours-fresh"))
FIGURES = (("wall", "whole process, s"), ("to_best", "to the best trial's last result, s"),
           ("units", "units (epochs) trained"), ("segment", "a segment, wall s (median of its segments)"),
           ("overhead", "a segment's overhead, s (wall - its units' train_seconds; median)"))  # fmt: skip


def table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown rows: each figure's median (min-max) per side and the ratios of the sides run, then each side's
    best trial."""
    sides = [s for s in SIDES if runs.get(s)]
    ratios = [(a, b) for a, b in RATIOS if a in sides and b in sides]
    head = "| figure | " + " | ".join([*sides, *(f"{a} / {b}" for a, b in ratios)]) + " |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for key, label in FIGURES:
        values = {s: [float(r[key]) for r in runs[s] if key in r] for s in sides}
        fmt = "{:.0f}" if key == "units" else "{:.2f}"
        cells = [spread(v, fmt) if v else "-" for v in values.values()]
        for a, b in ratios:
            ok = values[a] and values[b] and median(values[b]) > 0
            cells.append(f"{median(values[a]) / median(values[b]):.2f}x" if ok else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for side in SIDES:
        for r in runs.get(side, []):
            lines.append(f"- {side}: best {r['best_trial']} ({short(r['best_params'])}) {METRIC} "
                         f"{r['best_metric']:.4f}; units per trial {r['per_trial']} in {r['launches']} trial "
                         f"launches; {r['note']}")  # fmt: skip
    return lines


# -- Ray's side --------------------------------------------------------------------------------------
def ray_trainable(config: dict[str, Any]) -> None:
    """One trial, as Ray's guides write a function trainable: resumes from ``tune.get_checkpoint()``, reports each
    epoch's validation metrics with a checkpoint of the model, optimizer and scheduler."""
    import tempfile

    import torch
    from ray import tune
    from torch.utils.data import DataLoader

    from recipes.digits import DigitsRecipe, _Digits

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    recipe = DigitsRecipe(**recipe_kwargs(config["params"]))
    model = recipe.build_model()
    optimizer = recipe.build_optimizer(model)
    scheduler = recipe.build_scheduler(optimizer)
    start = 0
    if (checkpoint := tune.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["epoch"]
    train, val = recipe.train_dataset(), cast(_Digits, recipe.eval_dataset())  # its tensors, for one batch
    for epoch in range(start, EPOCHS):
        loader = DataLoader(
            train, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED + epoch)
        )
        model.train()
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            recipe.loss(model, batch).backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        with torch.no_grad():
            metrics = recipe.evaluate(model, (val.x, val.y))  # the whole split in one batch
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "epoch": epoch + 1}  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:
            torch.save(state, Path(folder) / "state.pt")
            tune.report({f"eval_{k}": v for k, v in metrics.items()}, checkpoint=tune.Checkpoint.from_directory(folder))


def run_ray(t0: float, folder: str) -> dict[str, Any]:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from bench.sweep_vs_ray import ray_trainable as trainable  # by reference, not __main__'s copy

    seen: dict[str, list[float]] = {}  # trial id -> times of its results (seconds since t0)

    class Clock(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            seen.setdefault(trial.trial_id, []).append(time.time() - t0)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        asha = ASHAScheduler(time_attr="training_iteration", max_t=EPOCHS, grace_period=1, reduction_factor=2)
        tuner = tune.Tuner(
            tune.with_resources(trainable, {"cpu": 1}),
            param_space=ray_param_space(trial_grid(SPACE)),
            tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, scheduler=asha, max_concurrent_trials=2),
            run_config=tune.RunConfig(storage_path=folder, name="sweep", verbose=0, callbacks=[Clock()]),
        )
        results = tuner.fit()
        best = results.get_best_result(METRIC, MODE, scope="all")
        history, metrics, config = best.metrics_dataframe, best.metrics, best.config
        if history is None or metrics is None or config is None:
            raise RuntimeError(f"Ray kept no metrics or config of its best trial: {best}")
        value = float(history[METRIC].min() if MODE == "min" else history[METRIC].max())
        trial_id = metrics["trial_id"]
        return {"best_trial": trial_id, "best_params": config["params"], "best_metric": value,
                "to_best": seen[trial_id][-1], "units": sum(len(v) for v in seen.values()),
                "trials": len(results), "per_trial": [len(seen[k]) for k in sorted(seen)], "launches": len(seen),
                "note": f"Ray {ray.__version__}, ray.init(num_cpus=2)"}  # fmt: skip
    finally:
        ray.shutdown()


# -- our side ----------------------------------------------------------------------------------------
def ledger(folder: Path) -> list[dict[str, Any]]:
    """The sweep's events in order (SWEEP_SPEC: <save_folder>/<sweep_name>/sweep/events/<seq>.json)."""
    return [json.loads(p.read_text()) for p in sorted((folder / "sweep" / "events").glob("*.json"))]


def from_ledger(events: list[dict[str, Any]], best_trial: str, t0: float) -> dict[str, Any]:
    """Units trained in all, the best trial's parameters and when its last segment finished (seconds since t0)."""
    finished = [e["body"] for e in events if e["kind"] == "segment_finished"]  # a failed segment's units count too
    ends = [e["time"] for e in events if e["kind"] == "segment_finished" and e["body"]["trial"] == best_trial]
    params = next(
        e["body"]["params"] for e in events if e["kind"] == "trial_created" and e["body"]["trial"] == best_trial
    )
    names = [e["body"]["trial"] for e in events if e["kind"] == "trial_created"]
    per_trial = [sum(int(b["units_trained"]) for b in finished if b["trial"] == name) for name in names]
    seconds, overheads = launch_seconds(events)
    return {"units": sum(per_trial), "best_params": params, "to_best": max(ends) - t0, "trials": len(names),
            "per_trial": per_trial, "launches": len(finished), "launch_seconds": seconds,
            "segment": median(seconds), "overhead": median(overheads)}  # fmt: skip


def launch_seconds(events: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Each segment's seconds from its segment_started to its segment_finished event, in the order they finished,
    and the same less the ``train_seconds`` of the units it trained (the last ``units_trained`` of its units)."""
    started: dict[tuple, float] = {}
    out, overheads = [], []
    for e in events:
        key = (e["body"].get("trial"), e["body"].get("run_name"), e["body"].get("target_units"))
        if e["kind"] == "segment_started":
            started[key] = e["time"]
        elif e["kind"] == "segment_finished" and key in started:
            wall = e["time"] - started.pop(key)
            trained = int(e["body"].get("units_trained") or 0)
            units = e["body"].get("units") or []
            busy = sum(float(u["metrics"].get("train_seconds", 0.0)) for u in units[len(units) - trained :])
            out.append(round(wall, 2))
            overheads.append(round(wall - busy, 2))
    return out, overheads


def run_ours(t0: float, folder: str) -> dict[str, Any]:
    from flows.sweep import sweep
    from tasks.trial_runner import PROCESS_PER_SEGMENT_ENV
    from training.config import TrainConfig
    from training.sweep.config import SweepConfig

    train = TrainConfig(save_folder=folder, recipe="digits", max_duration=f"{EPOCHS}ep", save_interval="1ep",
                        global_batch_size=BATCH, seed=SEED, eval_each_unit=True, progress_bar=False)  # fmt: skip
    config = SweepConfig(train=train, sweep_name="sweep", space=our_space(SPACE), num_samples=1,
                         max_concurrent_trials=2, scheduler="asha", metric=METRIC, mode=MODE, grace_period=1,
                         reduction_factor=2)  # fmt: skip
    result = sweep(config)
    out = from_ledger(ledger(Path(folder) / "sweep"), result.best_trial, t0)
    server = (
        f"running server {os.environ['PREFECT_API_URL']}"
        if os.environ.get("PREFECT_API_URL")
        else "sweep()'s own server"
    )
    value = result.best_value if hasattr(result, "best_value") else result.best_metric
    seconds = out["launch_seconds"]
    how = "a fresh process per segment" if os.environ.get(PROCESS_PER_SEGMENT_ENV) == "1" else "warm trial processes"
    note = (f"{server}; {how}; units_trained in the result: {result.units_trained}; a segment (trial launch) took "
            f"{median(seconds):.1f} s median ({min(seconds):.1f}-{max(seconds):.1f}) from segment_started to "
            f"segment_finished")  # fmt: skip
    out.update(best_trial=result.best_trial, best_metric=float(value), note=note)
    return out


def side_main(side: str) -> None:
    t0 = float(os.environ.get(T0) or time.time())
    folder = scratch(f"sweep-{side}-")
    figures = run_ray(t0, folder) if side == "ray" else run_ours(t0, folder)
    print(MARK + json.dumps(figures), flush=True)


# -- the parent: both sides, alternating -----------------------------------------------------------
def startup_phases(output: str) -> dict[str, float]:
    """The median seconds of each start-up phase over the segments whose first line is in ``output`` (the run's
    ``start-up 0.27 s (reset 0.00 s, flow run 0.12 s, ...)``, training/start/phases.py); empty on Ray's side."""
    seen: dict[str, list[float]] = {}
    for found in STARTUP.finditer(output):
        for part in found.group(1).split(", "):
            name, _, seconds = part.rpartition(" ")[0].rpartition(" ")
            if name:
                seen.setdefault(name, []).append(float(seconds))
    return {name: round(median(values), 2) for name, values in seen.items()}


def run_side(side: str) -> dict[str, Any]:
    from bench import whole
    from tasks.trial_runner import PROCESS_PER_SEGMENT_ENV  # the parent's import: Ray's side imports no torch of ours

    env = whole.child_env(1, PYTHONUNBUFFERED="1")
    if os.environ.get("PREFECT_API_URL"):  # the user's running server: our side uses it (child_env drops it)
        env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"]
    if side == "ours-fresh":
        env[PROCESS_PER_SEGMENT_ENV] = "1"
    env[T0] = repr(time.time())
    done = whole.run(whole.python("-m", "bench.sweep_vs_ray", "--side", side), env, timeout=1200)
    line = next(x for x in reversed(done.output.splitlines()) if x.startswith(MARK))
    figures = {**json.loads(line[len(MARK) :]), "wall": done.wall}
    phases = startup_phases(done.output)
    if phases:
        figures["note"] += "; a segment's start-up, median s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
    return figures


def main(argv: list[str]) -> None:
    p = parser("sweep", __doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1, help="alternating repetitions of each side")
    p.add_argument("--sides", default="ours,ray", help=f"which sides to run, comma-separated: {', '.join(SIDES)}")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # the child process of one side
    args = p.parse_args(argv)
    if args.side:
        side_main(args.side)
        return
    sides = [s for s in args.sides.split(",") if s]
    if not sides or set(sides) - set(SIDES):
        p.error(f"--sides {args.sides!r}: give one or more of {', '.join(SIDES)}, comma-separated")
    from bench import whole

    whole.compile_bytecode()  # as an installed package has it (Ray's has its own from pip), as the other benches do
    load = load_average()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(args.reps):
        for side in rotated(sides, rep):
            progress(f"rep {rep}: {side}")
            runs[side].append(run_side(side))
    head = [f"8 trials (digits, grid {short_space()}), ASHA grace_period 1, reduction_factor 2, max {EPOCHS} "
            f"units of 1 epoch, 2 at a time, CPU, 1 torch thread a trial; metric {METRIC} ({MODE}); "
            f"{args.reps} rep(s), alternating.", ""]  # fmt: skip
    record("Sweeps: ASHA in the sweep flow vs Ray Tune (issues 35, 46)", head + table(runs), load)


def short_space() -> str:
    return " x ".join(f"{k.removeprefix('recipe_args.')} {values}" for k, values in SPACE.items())


if __name__ == "__main__":
    main(sys.argv[1:])
