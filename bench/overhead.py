"""Overhead of never losing work: the same units as a plain PyTorch loop (no Prefect, no checkpoints) and as
the flow checkpointing to a local folder, and to S3 over HTTP (moto), synchronously and asynchronously.

Variants alternate within one run (each repetition starts one variant later); medians are reported. The
flow is timed from outside, by the timestamps of its own log lines ("unit N ... starting from", "unit N
done") and the figures each unit reports (train_seconds, checkpoint_seconds = the stall). Per unit:

    slowdown   = the unit's train_seconds - the plain loop's time for the same steps
    stall      = checkpoint_seconds (serialize, plus the commit when sync, or a wait for the previous upload)
    orchestration = "unit N done" -> "unit N+1 starting" (task return, artifacts, next task run, warm state)
    other      = the rest of the unit's span (log lines, keeping state warm)

Steady-state units only (the first unit has no upload in flight, the last one waits for its own upload);
the flow's start and end (server calls, final upload wait, final evaluation) are reported apart, once per run.
"""

from __future__ import annotations

import math
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field

from bench.common import (
    OUT,
    LocalS3,
    LogRecorder,
    children_cpu,
    cpu_by_thread_group,
    isolate_prefect,
    load_average,
    local_s3,
    median,
    parser,
    progress,
    record,
    rotated,
    scratch,
    spread,
)
from bench.plain import PlainRun, parameter_bytes, seconds_per_step, train_plain

RECIPE = "recipes.synthetic:SyntheticRecipe"
LABELS = {
    "plain": "plain PyTorch loop",
    "local": "flow, local folder (sync: the default)",
    "local-async": "flow, local folder, async_upload=True",
    "s3-sync": "flow, S3 over HTTP, sync",
    "s3-async": "flow, S3 over HTTP, async (the default for s3://)",
}
SEED = 1


@dataclass
class FlowRun:
    wall: float
    start: float  # call -> unit 0 starts (the plain loop's build is subtracted in the report)
    end: float  # last unit's wait for its upload + last unit done -> flow returns
    train: list[float] = field(default_factory=list)  # train_seconds of every unit
    losses: list[float] = field(default_factory=list)
    slowdown: list[float] = field(default_factory=list)  # train - the plain loop's same unit (set in the report)
    stall: list[float] = field(default_factory=list)
    orchestration: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)
    uploads: list[float] = field(default_factory=list)
    cpu_units: float = 0.0  # this process's CPU seconds from unit 0 starting to the last unit done
    cpu_where: dict[str, float] = field(default_factory=dict)  # CPU seconds of the whole run, by thread/process
    cpu_unit: list[float] = field(default_factory=list)  # ... from each unit starting to its done line


@dataclass(frozen=True)
class Shape:
    """What is trained: the same for the plain loop and every flow variant."""

    recipe_args: dict
    batch: int
    units: int
    steps: int

    def plain(self) -> PlainRun:
        return train_plain(self.recipe_args, self.batch, SEED, self.units, self.steps)


def _shape(hidden: int, layers: int, batch: int, units: int, steps: int) -> Shape:
    args = {"num_samples": 1 << 15, "in_features": 16, "hidden": hidden, "num_layers": layers, "eval_samples": 64}
    return Shape(args, batch, units, steps)


def _config(variant: str, s3: LocalS3, shape: Shape):
    from flows.train import TrainConfig

    if variant.startswith("s3"):
        folder, options = s3.fresh_bucket(f"bench-{uuid.uuid4().hex[:8]}"), s3.options
    else:
        folder, options = scratch("overhead-"), {}
    return TrainConfig(
        run_name=f"o{uuid.uuid4().hex[:8]}",
        save_folder=folder,
        storage_options=options,
        recipe=RECIPE,
        recipe_args=shape.recipe_args,
        max_duration=f"{shape.units * shape.steps}ba",
        save_interval=f"{shape.steps}ba",
        global_batch_size=shape.batch,
        seed=SEED,
        async_upload="async" in variant,
    )


def run_flow(variant: str, s3: LocalS3, shape: Shape) -> FlowRun:
    from flows.train import train
    from training.unit.warm import PROCESS

    config = _config(variant, s3, shape)
    PROCESS.forget()  # each run starts cold, as a new run does
    with LogRecorder("prefect.task_runs", "prefect.flow_runs", "checkpointing.uploader") as log:
        cpu_before = cpu_snapshot(s3)
        t_call = time.time()
        result = train(config)
        t_end = time.time()
        cpu_where = _minus(cpu_snapshot(s3), cpu_before)
    if not config.save_folder.startswith("s3://"):
        shutil.rmtree(config.save_folder, ignore_errors=True)
    n = shape.units
    begin, cpu_begin = zip(*[log.first(rf"^unit {i} \(attempt 1\): starting from") for i in range(n)], strict=False)
    done, cpu_done = zip(*[log.first(rf"^unit {i} done:") for i in range(n)], strict=False)
    m = [u.metrics for u in result.units]
    inside_rest = [done[i] - begin[i] - m[i]["train_seconds"] - m[i]["checkpoint_seconds"] for i in range(n)]
    uploads = [
        float(x)
        for *_, msg in log.records
        for x in re.findall(r"committed in the background: [\d.]+ MB in ([\d.]+)s", msg)
    ]
    return FlowRun(
        wall=t_end - t_call,
        start=begin[0] - t_call,
        end=inside_rest[-1] + t_end - done[-1],
        train=[x["train_seconds"] for x in m],
        losses=[x["loss"] for x in m],
        stall=[x["checkpoint_seconds"] for x in m[1:]],
        orchestration=[begin[i + 1] - done[i] for i in range(n - 1)],
        other=inside_rest[:-1],
        uploads=uploads,
        cpu_units=cpu_done[-1] - cpu_begin[0],
        cpu_unit=[d - b for b, d in zip(cpu_begin, cpu_done, strict=False)],
        cpu_where=cpu_where,
    )


def cpu_snapshot(s3: LocalS3) -> dict[str, float]:
    """CPU seconds so far: this process by thread group, the Prefect server's process, moto's process."""
    everything = children_cpu()
    without_moto = children_cpu(exclude={s3.pid})
    return {
        **cpu_by_thread_group(),
        "Prefect server process (test harness)": without_moto,
        "moto S3 server process": everything - without_moto,
    }


def _minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def plain_with_cpu(shape: Shape, s3: LocalS3) -> PlainRun:
    before = cpu_snapshot(s3)
    run = shape.plain()
    run.cpu_where = _minus(cpu_snapshot(s3), before)
    return run


def per_step_cost(s3: LocalS3, reps: int, steps: int = 1000) -> float:
    """CPU seconds the product's loop adds per step (sampler shares, progress, hooks, log checks): a tiny model,
    so that these dominate the step; local folder, flow vs plain, alternating; units 1..2 (their checkpoints
    are a few kB). CPU time of one thread, which other processes' load hardly moves."""
    import torch

    shape = _shape(hidden=8, layers=2, batch=8, units=3, steps=steps)
    extra, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no OpenMP spin-waiting in the CPU clock, only the work
    try:
        for rep in range(reps):
            for v in rotated(["plain", "local"], rep):
                if v == "plain":
                    plain = shape.plain()
                else:
                    flow = run_flow("local", s3, shape)
            extra += [(flow.cpu_unit[i] - plain.unit_cpu[i]) / steps for i in (1, 2)]
    finally:
        torch.set_num_threads(threads)
    return median(extra)


def _warm_up(s3: LocalS3) -> None:
    """One tiny flow per store kind: the process's first flow and task runs pay one-time client costs."""
    from flows.train import TrainConfig, train

    for folder, options in [(scratch("warm-"), {}), (s3.fresh_bucket("bench-warm"), s3.options)]:
        train(
            TrainConfig(
                run_name="warm",
                save_folder=folder,
                storage_options=options,
                recipe=RECIPE,
                recipe_args={"num_samples": 64, "hidden": 8, "eval_samples": 8},
                max_duration="4ba",
                save_interval="2ba",
                global_batch_size=8,
            )
        )


def _profile(variant: str, s3: LocalS3, shape: Shape) -> str:
    """One more run of ``variant`` under pyinstrument (not timed): where the flow's own time goes."""
    from pyinstrument import Profiler

    OUT.mkdir(exist_ok=True)
    profiler = Profiler(interval=0.005)
    profiler.start()
    run_flow(variant, s3, shape)
    profiler.stop()
    path = OUT / f"overhead-{variant}.html"
    path.write_text(profiler.output_html())
    (OUT / f"overhead-{variant}.txt").write_text(profiler.output_text(unicode=False, show_all=False))
    return str(path.relative_to(OUT.parent.parent))


def main(argv: list[str]) -> None:
    p = parser(
        "overhead",
        "Overhead per unit of the flow with checkpoints vs a plain PyTorch loop, and the stall per checkpoint.",
    )
    p.add_argument("--units", type=int, default=3, help="units per run (steady-state figures use units 1..n-1)")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions of every variant")
    p.add_argument(
        "--unit-seconds",
        type=float,
        default=5.0,
        help="target length of a unit, in seconds of plain training (sets --steps-per-unit); keep it "
        "above the upload time of one checkpoint, or the async stall includes waiting for it",
    )
    p.add_argument("--steps-per-unit", type=int, default=0, help="steps per unit (0: from --unit-seconds)")
    p.add_argument("--hidden", type=int, default=3584, help="width of the synthetic MLP")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthetic MLP")
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument(
        "--variants", default="plain,local,s3-sync,s3-async", help=f"comma-separated, from: {', '.join(LABELS)}"
    )
    p.add_argument("--profile", default="", help="also run this variant once under pyinstrument (bench/out/)")
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    if "plain" not in variants or any(v not in LABELS for v in variants) or a.units < 3:
        p.error(f"--variants={a.variants!r} must include 'plain' and name only {', '.join(LABELS)}; --units >= 3")
    load = load_average()
    isolate_prefect()
    from prefect.testing.utilities import prefect_test_harness

    shape = _shape(a.hidden, a.layers, a.batch, a.units, a.steps_per_unit or 1)
    if not a.steps_per_unit:
        step_s = seconds_per_step(shape.recipe_args, a.batch)
        shape = _shape(a.hidden, a.layers, a.batch, a.units, max(2, math.ceil(a.unit_seconds / step_s)))
    plains: list[PlainRun] = []
    flows: dict[str, list[FlowRun]] = {v: [] for v in variants if v != "plain"}
    with prefect_test_harness(server_startup_timeout=180), local_s3() as s3:
        _warm_up(s3)
        step_cost = per_step_cost(s3, a.reps)
        for rep in range(a.reps):
            for v in rotated(variants, rep):
                if v == "plain":
                    plains.append(plain_with_cpu(shape, s3))
                    progress(f"rep {rep} plain: units {[round(x, 2) for x in plains[-1].unit_seconds]} s")
                else:
                    flows[v].append(run_flow(v, s3, shape))
                    progress(
                        f"rep {rep} {v}: train {[round(x, 2) for x in flows[v][-1].train]} s, "
                        f"stall {[round(x, 2) for x in flows[v][-1].stall]} s, wall {flows[v][-1].wall:.1f} s"
                    )
        profile = _profile(a.profile, s3, shape) if a.profile else ""
    _report(a, shape, step_cost, plains, flows, load, profile)


def _report(
    a, shape: Shape, step_cost: float, plains: list[PlainRun], flows: dict[str, list[FlowRun]], load: str, profile: str
) -> None:
    n, steps = shape.units, shape.steps
    plain_unit = [median([p.unit_seconds[i] for p in plains]) for i in range(n)]  # per index: unit 0 warms up
    unit = median(plain_unit[1:])
    plain_cpu = median([sum(p.unit_cpu) for p in plains]) / n
    plain_cpu / median([sum(p.unit_seconds) / n for p in plains])  # CPU-s per s of plain training
    per_step = step_cost * steps / plain_cpu  # the product loop's own per-step cost, as a fraction of training
    build = median([p.build_seconds for p in plains])
    for runs in flows.values():
        for r in runs:
            r.slowdown = [r.train[i] - plain_unit[i] for i in range(1, n)]
            r.start -= build
    mb = parameter_bytes(shape.recipe_args) / 1e6
    pool = lambda runs, attr: [x for r in runs for x in getattr(r, attr)]  # noqa: E731
    lines = [
        f"Model: synthetic MLP, hidden {a.hidden} x {a.layers} layers = {mb:.0f} MB of parameters; with SGD momentum "
        f"a checkpoint is ~{2 * mb:.0f} MB. Batch {a.batch}; {n} units of {steps} steps ({unit:.1f} s of plain "
        f"training each, measured); {a.reps} alternating repetitions. Prefect: a server already running "
        "(`prefect_test_harness`, started once); S3: moto's ThreadedMotoServer in a child process on loopback "
        "(same 2 cores).",
        "",
        f"**Measured, wall time** (medians over units 1..{n - 1} of every repetition; min-max in brackets). 'Direct' "
        "is the time the training thread spends not training: stall + orchestration + other. 'Slowdown' is the "
        "unit's training time minus the plain loop's: it holds the CPU an upload in the background takes from "
        "training, and most of this machine's noise.",
        "",
        "| variant | run wall s | stall s/checkpoint | orchestration s/unit | other s/unit | direct s/unit "
        "| slowdown s/unit | once per run: start / end s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {LABELS['plain']} | {median([p.build_seconds + sum(p.unit_seconds) for p in plains]):.1f} | - | - | - "
        "| - | - | - |",
    ]
    summary = {}
    for v, runs in flows.items():
        stall, orch = median(pool(runs, "stall")), median(pool(runs, "orchestration"))
        direct, slow = stall + orch + median(pool(runs, "other")), median(pool(runs, "slowdown"))
        cpu_extra = median([(r.cpu_units - sum(p.unit_cpu)) / n for r, p in zip(runs, plains, strict=False)])
        summary[v] = (stall, direct, slow, cpu_extra)
        lines.append(
            f"| {LABELS[v]} | {median([r.wall for r in runs]):.1f} | {spread(pool(runs, 'stall'))} | "
            f"{spread(pool(runs, 'orchestration'))} | {median(pool(runs, 'other')):.2f} | {direct:.2f} | "
            f"{spread(pool(runs, 'slowdown'))} | {median([r.start for r in runs]):.1f} / "
            f"{median([r.end for r in runs]):.1f} |"
        )
    lines += [
        "",
        f"**Measured, CPU time of this process** (all its threads; the Prefect server and moto run in "
        "other processes, as they would on other machines): CPU seconds per unit over the plain loop's "
        f"{plain_cpu:.1f} CPU-s per unit, from unit 0 starting to the last unit done, divided by {n} (it "
        "holds every checkpoint's serialization, hashing and upload once). Other processes' load hardly "
        "moves this clock.",
        "",
        "| variant | extra CPU-s per unit | % of the plain unit's CPU |",
        "| --- | --- | --- |",
    ]
    for v, (_, _, _, cpu_extra) in summary.items():
        lines.append(f"| {LABELS[v]} | {cpu_extra:.2f} | {100 * cpu_extra / plain_cpu:.1f} % |")
    groups = sorted(
        {g for p in plains for g in p.cpu_where} | {g for runs in flows.values() for r in runs for g in r.cpu_where}
    )
    lines += [
        "",
        f"Where the CPU goes: CPU seconds of the whole run divided by {n} units (median over repetitions), "
        "by thread of this process (Python thread names) and by process on this machine:",
        "",
        "| CPU-s per unit | " + " | ".join(LABELS[v] for v in ["plain", *flows]) + " |",
        "| --- |" + " --- |" * (1 + len(flows)),
    ]
    for g in groups:
        cells = [median([p.cpu_where.get(g, 0.0) / n for p in plains])]
        cells += [median([r.cpu_where.get(g, 0.0) / n for r in runs]) for runs in flows.values()]
        lines.append(f"| {g} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines += [
        "",
        f"The product's loop adds {step_cost * 1e6:.0f} CPU-us per step (one thread, a tiny model, flow vs "
        f"plain, alternating): {100 * per_step:.2f} % of a step here, the only part that grows with the "
        "unit. The rest is paid once per unit, whatever its length.",
        "",
        "**Computed for 30 s units**: per-step % + (direct + slowdown) / 30 s, a negative slowdown counted as 0 "
        "(the conservative figure, which sets the verdict); 'direct only' leaves out the slowdown, i.e. "
        "assumes an upload in the background costs training nothing (a machine with a core to spare). The "
        "once-per-run start and end are not in it.",
        "",
        "| variant | overhead for a 30 s unit | direct only | goal <= 2 % |",
        "| --- | --- | --- | --- |",
    ]
    for v, (_stall, direct, slow, _cpu_extra) in summary.items():
        full = 100 * (per_step + (direct + max(slow, 0.0)) / 30)
        lines.append(
            f"| {LABELS[v]} | {full:.1f} % | {100 * (per_step + direct / 30):.1f} % | "
            f"{'met' if full <= 2 else 'missed'} |"
        )
    if "s3-sync" in summary and "s3-async" in summary:
        ratio = summary["s3-async"][0] / summary["s3-sync"][0]
        lines += [
            "",
            f"Async stall / sync stall (S3): {summary['s3-async'][0]:.2f} / {summary['s3-sync'][0]:.2f} s = "
            f"{ratio:.2f} (goal <= 0.10: {'met' if ratio <= 0.10 else 'missed'}).",
        ]
        uploads = pool(flows["s3-async"], "uploads")
        if uploads:
            lines.append(
                f"Background upload of one checkpoint: {spread(uploads)} s, against units of {unit:.1f} s"
                + (
                    " (longer than a unit: the next checkpoint waited for it, which the stall includes)."
                    if median(uploads) > unit
                    else "."
                )
            )
    plain_losses = plains[0].unit_losses
    diff = max(
        abs(x - y) for runs in flows.values() for r in runs for x, y in zip(r.losses, plain_losses, strict=False)
    )
    lines += [
        "",
        f"Same training: every flow unit's mean loss equals the plain loop's (largest difference {diff:.1e})."
        if diff < 1e-6
        else f"Warning: unit losses differ from the plain loop's by up to {diff:.1e}.",
    ]
    if profile:
        lines.append(f"Profile of one more run ({a.profile}, not timed): {profile}")
    record("Overhead of the product (goals: <= 2 % for 30 s units; async stall <= 10 % of sync)", lines, load)
