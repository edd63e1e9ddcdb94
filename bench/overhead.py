"""Overhead of never losing work: the same units as a plain PyTorch loop (no Prefect, no checkpoints)
and as the flow checkpointing to a local folder, to S3 over HTTP synchronously, and asynchronously.

Run alternating, several repetitions, medians. The stall is what a checkpoint costs training:
serialization plus (sync) the commit, or (async) any wait for the previous upload.
"""

from __future__ import annotations

import tempfile
import time
import uuid

import torch
from torch.utils.data import DataLoader

from bench.common import command_line, isolate_prefect, local_s3, median, record

RECIPE = "recipes.synthetic:SyntheticRecipe"


def plain_loop(args: dict, gbs: int, seed: int, steps: int) -> float:
    """The same model, data order and optimizer steps, written the plain way."""
    from recipes.synthetic import SyntheticRecipe
    from training import rng
    from training.sampler import ResumableBatchSampler

    recipe = SyntheticRecipe(**args)
    data = recipe.train_dataset()
    rng.seed_all(seed)
    model = recipe.build_model()
    opt = recipe.build_optimizer(model)
    sched = recipe.build_scheduler(opt)
    t0, done, epoch = time.perf_counter(), 0, 0
    while done < steps:
        for batch in DataLoader(data, batch_sampler=ResumableBatchSampler(len(data), gbs, seed=seed, epoch=epoch)):
            opt.zero_grad(set_to_none=True)
            recipe.loss(model, batch).backward()
            opt.step()
            sched.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    return time.perf_counter() - t0


def run(hidden: int = 5120, steps_per_unit: int = 40, reps: int = 2) -> None:
    """Runs of 1 and of 3 units for each variant: the difference is what each further unit costs,
    free of the one-time flow start and final evaluation."""
    isolate_prefect()
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import TrainConfig, train
    from training.session import forget_warm_state

    args = {"num_samples": 1 << 16, "in_features": 16, "hidden": hidden, "num_layers": 3, "eval_samples": 32}
    gbs, seed = 32, 1
    walls: dict[tuple[str, int], list[float]] = {}
    stalls: dict[str, list[float]] = {}
    with prefect_test_harness(server_startup_timeout=180), local_s3() as (bucket, options):
        local = tempfile.mkdtemp(prefix="bench-overhead-")
        variants = {
            "flow, local folder": dict(save_folder=local),
            "flow, S3 sync upload": dict(save_folder=f"{bucket}/runs", storage_options=options, async_upload=False),
            "flow, S3 async upload": dict(save_folder=f"{bucket}/runs", storage_options=options, async_upload=True),
        }
        plain_loop(args, gbs, seed, 3)  # warm-up
        for _ in range(reps):
            for units in (1, 3):
                steps = steps_per_unit * units
                walls.setdefault(("plain loop", units), []).append(plain_loop(args, gbs, seed, steps))
                for name, extra in variants.items():
                    forget_warm_state()
                    config = TrainConfig(run_name=f"b{uuid.uuid4().hex[:8]}", recipe=RECIPE, recipe_args=args,
                                         max_duration=f"{steps}ba", save_interval=f"{steps_per_unit}ba",
                                         global_batch_size=gbs, seed=seed, log_every_n_steps=10**9, **extra)
                    t0 = time.perf_counter()
                    result = train(config)
                    walls.setdefault((name, units), []).append(time.perf_counter() - t0)
                    stalls.setdefault(name, []).extend(u.metrics["checkpoint_seconds"] for u in result.units)
    _report({k: median(v) for k, v in walls.items()}, stalls, hidden, steps_per_unit, reps)


def _report(wall, stalls, hidden, steps_per_unit, reps) -> None:
    params = 16 * hidden + hidden * hidden + hidden * 4
    unit_s = (wall[("plain loop", 3)] - wall[("plain loop", 1)]) / 2
    lines = [f"Model: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB; with SGD momentum a checkpoint is "
             f"~{params * 8 / 1e6:.0f} MB). Units of {steps_per_unit} steps (~{unit_s:.1f} s of plain training). "
             f"Each variant ran with 1 and with 3 units, {reps} alternating repetitions, medians; 'per further "
             f"unit' = (wall(3) - wall(1)) / 2 minus the same for the plain loop, so the one-time flow start and "
             f"final evaluation drop out. Prefect server already running (test harness).", "",
             "| variant | wall s, 1 unit / 3 units | one-time cost | overhead per further unit | "
             "stall per checkpoint | per further unit, for a 30 s unit |", "| --- | --- | --- | --- | --- | --- |",
             f"| plain loop | {wall[('plain loop', 1)]:.1f} / {wall[('plain loop', 3)]:.1f} | - | - | - | - |"]
    for name in sorted({n for n, _ in wall} - {"plain loop"}):
        per_unit = (wall[(name, 3)] - wall[(name, 1)]) / 2 - unit_s
        once = wall[(name, 1)] - wall[("plain loop", 1)] - per_unit
        lines.append(f"| {name} | {wall[(name, 1)]:.1f} / {wall[(name, 3)]:.1f} | {once:.1f} s | "
                     f"{per_unit:.2f} s ({100 * per_unit / unit_s:.1f} %) | {median(stalls[name]):.2f} s | "
                     f"{100 * per_unit / 30:.1f} % |")
    ratio = median(stalls["flow, S3 async upload"]) / median(stalls["flow, S3 sync upload"])
    lines += ["", f"Async stall / sync stall: {ratio:.2f} (goal <= 0.10).",
              "moto's server runs in this process on the same 2 cores as training, so an upload in the background "
              "slows training here; against a remote store the upload is I/O-bound and overlaps cleanly."]
    record("Overhead of the product (goal: <= 2 % for 30 s units)", command_line(), lines)
