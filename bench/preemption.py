"""What a polite termination costs (issue 21): SIGTERM in the middle of a unit, with the feature and without it.

Whole commands (``python -m flows.train``, a Prefect server this benchmark holds), a ~200 MB state (the synthetic
MLP, ``--hidden``), a checkpoint per epoch, to a local folder and to S3 (moto over HTTP on loopback). Each trial:

1. launch the run; when its recipe has trained ``--at`` of the second epoch (unit 1), send the process a real
   SIGTERM and time how long it takes to exit, and with what exit status;
2. relaunch the same command and let it finish; count every training step both processes took.

*Work lost* = the steps trained twice (both launches' steps minus the run's steps), also in seconds of this run's
own step time. With the feature (``preemption_signals`` default ``["SIGTERM"]``) training stops at the next step
boundary and commits a checkpoint there; without it (``--preemption_signals '[]'``: Python's default action, the
process ends at once) the relaunch retrains everything since the last unit's checkpoint. The relaunch's weights are
the product's business (tests/integration/test_preemption.py proves them bit-identical); this measures time.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import whole
from bench.common import isolate_prefect, load_average, local_s3, median, parser, progress, record, scratch, spread
from recipes.synthetic import SyntheticRecipe

RECIPE = "bench.preemption:StepClockRecipe"


class StepClockRecipe(SyntheticRecipe):
    """The synthetic recipe, appending the time of every training step to ``<clock_dir>/steps`` (the benchmark's
    count of the steps a process trained, and their pace)."""

    def __init__(self, clock_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.clock_dir = clock_dir

    def on_train_batch(self, sample_ids: list[int]) -> None:
        with open(os.path.join(self.clock_dir, "steps"), "a") as f:
            f.write(f"{time.time():.4f}\n")


@dataclass
class Trial:
    exit_seconds: float
    exit_code: int
    steps_lost: int
    step_seconds: float
    stop_line: str


@dataclass
class Figures:
    trials: dict[tuple[str, str], list[Trial]] = field(default_factory=dict)  # (store, variant) -> trials


def steps(clock: Path) -> list[float]:
    path = clock / "steps"
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def trial(store: str, variant: str, job: dict, env: dict[str, str], s3: object | None) -> Trial:
    clock = Path(scratch("clock-"))
    if store == "s3":
        assert s3 is not None
        folder = s3.fresh_bucket("preempt")  # type: ignore[attr-defined]
        storage = ["--storage_options", json.dumps(s3.options)]  # type: ignore[attr-defined]
    else:
        folder, storage = scratch("runs-"), []
    args = {
        "clock_dir": str(clock),
        "num_samples": job["samples"],
        "hidden": job["hidden"],
        "num_layers": job["layers"],
    }
    cmd = whole.python("-m", "flows.train", "--recipe", RECIPE, "--recipe_args", json.dumps(args),
                       "--global_batch_size", str(job["batch"]), "--max_duration", "3ep", "--save_interval", "1ep",
                       "--run_name", "preempt", "--save_folder", folder, *storage)  # fmt: skip
    if variant == "without":
        cmd += ["--preemption_signals", "[]"]
    per_epoch = job["samples"] // job["batch"]
    at = per_epoch + int(job["at"] * per_epoch)
    proc = subprocess.Popen(cmd, env=env, cwd=whole.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 900
    while len(steps(clock)) < at:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the run ended before step {at}: {(proc.stdout.read() if proc.stdout else '')[-2000:]}")
        time.sleep(0.02)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    exit_seconds = time.perf_counter() - t0
    first = steps(clock)
    stop = next((ln for ln in reversed(out.splitlines()) if ln.startswith("error: ")), "")  # the command's last word
    whole.run(cmd, env, timeout=900)  # the relaunch, to the end
    every = steps(clock)
    second = every[len(first) :]
    pace = median([b - a for a, b in itertools.pairwise(second[1:])])  # the relaunch's own step time
    return Trial(exit_seconds, proc.returncode, len(every) - 3 * per_epoch, pace, stop[-200:])


def measure(job: dict, reps: int, stores: list[str], threads: int) -> Figures:
    figures = Figures()
    env = whole.child_env(threads)
    with whole.held_server() as api:
        env["PREFECT_API_URL"] = api
        s3_context = local_s3() if "s3" in stores else None
        s3 = s3_context.__enter__() if s3_context else None
        try:
            if s3 is not None:
                env.update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})
            for rep in range(reps):
                for store in stores:
                    variants = ["feature", "without"] if rep % 2 == 0 else ["without", "feature"]
                    for variant in variants:
                        progress(f"rep {rep + 1}/{reps}: {store}, {variant}")
                        t = trial(store, variant, job, env, s3)
                        progress(f"  exit {t.exit_code} after {t.exit_seconds:.1f} s; {t.steps_lost} step(s) lost")
                        figures.trials.setdefault((store, variant), []).append(t)
        finally:
            if s3_context is not None:
                s3_context.__exit__(None, None, None)
    return figures


def state_megabytes(job: dict) -> float:
    model = SyntheticRecipe(num_samples=64, hidden=job["hidden"], num_layers=job["layers"]).build_model()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return parameters * 2 / 1e6  # weights + SGD momentum


def report(figures: Figures, job: dict, reps: int, load: str) -> None:
    per_epoch = job["samples"] // job["batch"]
    lines = [
        f"Job: synthetic MLP hidden {job['hidden']} x {job['layers']} layers (~{state_megabytes(job):.0f} MB of weights and optimizer state "
        f"per checkpoint), {job['samples']} samples per epoch in batches of {job['batch']} ({per_epoch} steps), "
        f"3 epochs, a checkpoint per epoch; SIGTERM at step {per_epoch + int(job['at'] * per_epoch)} "
        f"({job['at']:.0%} into unit 1); a Prefect server held by the benchmark; {reps} trial(s) each, medians "
        "(min-max).",
        "",
        "| store | preemption_signals | SIGTERM -> exit (s) | exit status | steps trained twice | work lost (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (store, variant), trials in figures.trials.items():
        lost = [t.steps_lost * t.step_seconds for t in trials]
        codes = sorted({t.exit_code for t in trials})
        lines.append(
            f"| {store} | {'SIGTERM (default)' if variant == 'feature' else '[] (without)'} | "
            f"{spread([t.exit_seconds for t in trials], '{:.1f}')} | {', '.join(map(str, codes))} | "
            f"{spread([float(t.steps_lost) for t in trials], '{:.0f}')} | {spread(lost, '{:.1f}')} |"
        )
    stops = {t.stop_line for ts in figures.trials.values() for t in ts if t.stop_line}
    if stops:
        lines += ["", "The command's last line at the terminal, e.g.:", "", *[f"    {line}" for line in sorted(stops)]]
    lines += [
        "",
        "Work lost = steps trained twice x the relaunch's median step time. With the feature the exit waits for "
        "the checkpoint of the ~200 MB state (and for an upload in flight); its exit status is 143 (128 + SIGTERM) "
        "so that a scheduler sees a termination, not a success. Without it Python's default action ends the process "
        "at once (exit -15: killed by the signal) and the relaunch retrains from the last unit's checkpoint.",
    ]
    record("Preemption: SIGTERM mid-unit, with and without checkpoint-on-signal", lines, load)


def main(argv: list[str]) -> None:
    p = parser("preemption", __doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=3584, help="width of the synthetic MLP (~200 MB of state at 3584)")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthetic MLP (3584 x 4: ~200 MB of state)")
    p.add_argument("--samples", type=int, default=6400, help="samples per epoch (= one unit)")
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--at", type=float, default=0.5, help="where in unit 1 the SIGTERM arrives (fraction of it)")
    p.add_argument("--reps", type=int, default=2, help="trials of each variant")
    p.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    a = p.parse_args(argv)
    isolate_prefect()
    whole.compile_bytecode()
    load = load_average()
    job = {"hidden": a.hidden, "layers": a.layers, "samples": a.samples, "batch": a.batch, "at": a.at}
    figures = measure(job, a.reps, a.stores.split(","), a.threads)
    report(figures, job, a.reps, load)
