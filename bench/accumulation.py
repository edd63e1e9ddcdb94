"""Gradient accumulation: does memory actually drop, and what does it cost in speed?

Each variant trains one unit of the synthetic MLP (wide layers, a big global batch: activations dominate)
through ``training.unit.loop.run_unit`` in a fresh process, and reports that process's peak RSS above its RSS
right before the unit, plus samples/s. The peak includes what every variant holds alike (dataset, model,
gradients, momentum, the checkpoint save); what differs between variants is the saved activations.
Variants alternate within one run; figures are medians.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import load_average, median, parser, progress, record, rotated, scratch, spread

CHILD = r"""
import json, resource, sys, time
from training.config import TrainConfig
from training.unit.loop import run_unit
from training.recipe.loader import allow_recipe
cfg = TrainConfig(**json.loads(sys.argv[1]))
import os
# The peak so far (imports) must not hide the unit's: compare against RSS now, and read the peak after.
rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
t0 = time.perf_counter()
result = run_unit(cfg)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_over_start": peak - rss0, "samples_per_second": result.metrics["samples_per_second"]}))
"""


def _one(config: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(config)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    p = parser("accumulation", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--global-batch-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    load = load_average()
    folder = scratch("accum-")
    base = dict(
        save_folder=folder,
        recipe="recipes.synthetic:SyntheticRecipe",
        recipe_args={
            "num_samples": args.global_batch_size * args.steps,
            "in_features": 512,
            "hidden": args.hidden,
            "num_layers": 4,
            "dropout": 0.0,
        },
        global_batch_size=args.global_batch_size,
        max_duration=f"{args.steps}ba",
        save_interval=f"{args.steps}ba",
        seed=0,
    )
    variants = [1, 4, 16]
    results: dict[int, list[dict]] = {k: [] for k in variants}
    for rep in range(args.repeats):
        for k in rotated(variants, rep):
            progress(f"repeat {rep + 1}/{args.repeats}: grad_accumulation={k}")
            results[k].append(_one({**base, "run_name": f"a{k}-r{rep}", "grad_accumulation": k}))
    mb = [median([r["peak_over_start"] for r in results[k]]) / 1e6 for k in variants]
    rate = [median([r["samples_per_second"] for r in results[k]]) for k in variants]
    activations = args.global_batch_size * args.hidden * 4 * 3 * 3 / 1e6  # ~3 saved tensors x 3 wide layers
    lines = [
        f"Synthetic MLP 512 -> {args.hidden} x 3 -> 4, global batch {args.global_batch_size}, {args.steps} steps "
        f"+ one checkpoint, one process, fresh process per measurement, {args.repeats} alternating repetitions. "
        f"Peak RSS of the unit above the process's RSS before it: dataset, model, gradients, momentum and the "
        f"checkpoint save (the same in every variant) plus the saved activations, about {activations:.0f} MB for "
        f"the whole batch at once.",
        "",
        "| grad_accumulation | micro-batch | peak above start, MB | vs 1 | samples/s | vs 1 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, k in enumerate(variants):
        peaks = [r["peak_over_start"] / 1e6 for r in results[k]]
        rates = [r["samples_per_second"] for r in results[k]]
        lines.append(
            f"| {k} | {args.global_batch_size // k} | {spread(peaks, '{:.0f}')} | {mb[i] / mb[0]:.2f} | "
            f"{spread(rates, '{:.0f}')} | {rate[i] / rate[0]:.2f} |"
        )
    record("Gradient accumulation: peak memory and speed (issue 11)", lines, load)
