"""GPT recipe (the nanoGPT port): the product's units against a bare PyTorch loop, in one process and as whole
processes.

In one process, alternating, the same optimizer steps of ``recipes.gpt`` (model, AdamW groups, warm-up + cosine
schedule, gradient accumulation, clipping, bf16 autocast) three ways:

* ``product``: ``training.unit.loop.run_unit`` unit after unit, each committing a checkpoint to a local folder, the next
  one taking the state the previous one committed (as the ``train`` flow's tasks do, minus Prefect);
* ``bare``: a plain loop over the same sample order (``ResumableBatchSampler`` + ``DataLoader``), no checkpoints.
  Its final weights are compared with the product's last checkpoint: equal means both trained the same thing;
* ``bare-nanogpt``: the same loop fed the way nanoGPT's ``get_batch`` does (random offsets, slices of one tensor),
  which the map-style dataset the product needs replaces (docs/porting-nanogpt.md).

Then whole processes, alternating: ``python -m flows.train --recipe gpt ...`` (imports, Prefect's temporary server,
flow, shutdown), the same with ``PREFECT_API_URL`` naming a running server, and ``python -c`` running the bare loop
for the same steps. The product's own log-line timestamps split its wall time into before the flow, the flow and
after it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Sized
from dataclasses import dataclass, field
from typing import Any, cast

from bench.common import (
    free_port,
    isolate_prefect,
    load_average,
    median,
    parser,
    progress,
    record,
    rotated,
    scratch,
    spread,
)

_TS = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \| INFO .*Flow run '[^']*' - (Beginning flow run|Finished in state)")


@dataclass
class Shape:
    steps: int
    steps_per_unit: int
    global_batch_size: int
    grad_accumulation: int
    recipe_args: dict
    seed: int = 42


@dataclass
class Run:
    build_seconds: float = 0.0
    unit_seconds: list[float] = field(default_factory=list)  # per unit (product) or per chunk of as many steps
    checkpoint_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean loss per unit
    cpu_seconds: float = 0.0  # this process's CPU time over the whole run (all threads)
    state: dict = field(default_factory=dict)  # final weights

    @property
    def total(self) -> float:
        return self.build_seconds + sum(self.unit_seconds)


def config_for(shape: Shape, folder: str, run_name: str):
    from training.config import TrainConfig

    return TrainConfig(
        run_name=run_name, save_folder=folder, recipe="gpt", recipe_args=shape.recipe_args, seed=shape.seed,
        max_duration=f"{shape.steps}ba", save_interval=f"{shape.steps_per_unit}ba",
        global_batch_size=shape.global_batch_size, grad_accumulation=shape.grad_accumulation, grad_clip_norm=1.0,
        precision="bf16",
    )  # fmt: skip


def train_product(shape: Shape, folder: str, run_name: str) -> Run:
    """Units of ``steps_per_unit`` steps through ``run_unit``, each committing a checkpoint to ``folder``."""
    from checkpointing import CheckpointStore
    from checkpointing.store import STATE_FILE
    from training.unit.loop import run_unit
    from training.unit.warm import SessionCache

    config, cache, run, start = config_for(shape, folder, run_name), SessionCache(), Run(), None
    cpu = time.process_time()
    while True:
        t0 = time.perf_counter()
        result = run_unit(config, start_checkpoint=start, cache=cache)
        run.unit_seconds.append(time.perf_counter() - t0)
        run.checkpoint_seconds.append(result.metrics["checkpoint_seconds"])
        run.losses.append(result.metrics["train_loss"])
        start = result.checkpoint_name
        if result.complete:
            break
    run.cpu_seconds = time.process_time() - cpu
    store = CheckpointStore(folder, run_name)
    run.state = store.load(start, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]
    cache.forget()
    return run


def train_bare(shape: Shape, nanogpt_batches: bool = False) -> Run:
    """The same steps as a plain loop: no Prefect, no checkpoints. ``nanogpt_batches``: random offsets sliced out
    of the token tensor (nanoGPT's ``get_batch``) instead of the product's sample order and DataLoader."""
    import torch
    from torch.utils.data import DataLoader

    from recipes.gpt import GPTRecipe, warmup_cosine
    from training.position.sampler import ResumableBatchSampler

    t0, cpu = time.perf_counter(), time.process_time()
    recipe = GPTRecipe(**shape.recipe_args)
    data = recipe.train_dataset()
    torch.manual_seed(shape.seed)  # the product's seeding order: seed, then build
    model = recipe.build_model()
    optimizer = recipe.build_optimizer(model)
    lr_at = warmup_cosine(recipe.lr, recipe.min_lr, recipe.warmup_steps, shape.steps - 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_at(it) / recipe.lr)
    accum = shape.grad_accumulation
    if nanogpt_batches:
        micro = shape.global_batch_size // accum
        tokens, block, g = recipe._train, recipe.block_size, torch.Generator().manual_seed(shape.seed)

        def get_batch():  # nanoGPT: torch.randint offsets, x and y stacked from slices of one tensor
            ix = torch.randint(len(tokens) - block, (micro,), generator=g)
            return torch.stack([tokens[i : i + block] for i in ix]), torch.stack(
                [tokens[i + 1 : i + 1 + block] for i in ix]
            )

        batches: Iterator[Any] = (get_batch() for _ in iter(int, 1))
    else:
        sampler = ResumableBatchSampler(len(cast(Sized, data)), shape.global_batch_size, seed=shape.seed, epoch=0,
                                        micro_batches=accum)  # fmt: skip
        batches = iter(DataLoader(data, batch_sampler=sampler, generator=torch.Generator().manual_seed(0)))
    model.train()
    run = Run(build_seconds=time.perf_counter() - t0)
    losses, t_unit = [], time.perf_counter()
    for step in range(shape.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            x, y = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = recipe.loss(model, (x, y))
            (loss / accum).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(total / accum)
        if (step + 1) % shape.steps_per_unit == 0:
            run.unit_seconds.append(time.perf_counter() - t_unit)
            run.losses.append(sum(losses) / len(losses))
            losses, t_unit = [], time.perf_counter()
    run.cpu_seconds = time.process_time() - cpu
    run.state = model.state_dict()
    return run


# -- whole processes ------------------------------------------------------------------------------
def flow_command(shape: Shape, folder: str, run_name: str) -> list[str]:
    return [
        sys.executable, "-m", "flows.train", "--recipe", "gpt", "--run_name", run_name, "--save_folder", folder,
        "--max_duration", f"{shape.steps}ba", "--global_batch_size", str(shape.global_batch_size),
        "--grad_accumulation", str(shape.grad_accumulation), "--grad_clip_norm", "1.0", "--precision", "bf16",
        "--save_interval", f"{shape.steps_per_unit}ba", "--eval_interval", f"{shape.steps_per_unit}ba",
        "--seed", str(shape.seed), "--recipe_args", json.dumps(shape.recipe_args),
    ]  # fmt: skip


def bare_command(shape: Shape) -> list[str]:
    code = f"from bench.gpt import Shape, train_bare; train_bare(Shape(**{shape.__dict__!r}))"
    return [sys.executable, "-c", code]


def timed_process(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, float]:
    """(wall seconds, CPU seconds of the process and the children it waited for (a temporary Prefect server),
    seconds before the flow began, seconds after it finished) of one process; the split comes from the product's
    own log-line timestamps (0, 0 for a process that logs none)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall, after = time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {out.returncode}: {out.stderr[-2000:]}")
    marks: dict[str, float] = {}
    for line in (out.stdout + out.stderr).splitlines():
        if m := _TS.match(line):
            day = datetime.datetime.fromtimestamp(start).date()
            t = datetime.datetime.combine(day, datetime.time.fromisoformat(m.group(1))).timestamp()
            marks.setdefault(m.group(2), t)
    if len(marks) < 2:
        return wall, cpu, 0.0, 0.0
    return wall, cpu, marks["Beginning flow run"] - start, start + wall - marks["Finished in state"]


def _env(threads: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_") and k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=os.getcwd(), PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="INFO", PREFECT_PORT=str(free_port()))
    env.update(OMP_NUM_THREADS=str(threads))
    env.update(extra)  # a free PREFECT_PORT: no server someone else runs on 4200 is found and used
    return env


def in_process(shape: Shape, reps: int) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {"product": [], "bare": [], "bare-nanogpt": []}
    for rep in range(reps):
        for name in rotated(list(runs), rep):
            if name == "product":
                run = train_product(shape, scratch("gpt-"), f"rep{rep}")
            else:
                run = train_bare(shape, nanogpt_batches=name == "bare-nanogpt")
            runs[name].append(run)
            progress(f"in-process rep {rep + 1}/{reps}: {name} {run.total:.1f}s")
    return runs


def whole_processes(shape: Shape, reps: int, threads: int) -> dict[str, list[tuple[float, float, float, float]]]:
    from flows.server import prefect_api

    times: dict[str, list[tuple[float, float, float, float]]] = {
        "flow, temporary server": [], "flow, running server": [], "bare python -c": [],
    }  # fmt: skip
    with prefect_api() as url:  # a running server for the second variant, started once
        for rep in range(reps):
            for name in rotated(list(times), rep):
                if name == "bare python -c":
                    cmd, env = bare_command(shape), _env(threads)
                else:
                    cmd = flow_command(shape, scratch("gpt-proc-"), f"proc{rep}")
                    env = _env(threads, PREFECT_API_URL=url) if "running" in name else _env(threads)
                times[name].append(timed_process(cmd, env))
                progress(f"process rep {rep + 1}/{reps}: {name} {times[name][-1][0]:.1f}s")
    return times


def report(shape: Shape, runs: dict[str, list[Run]], procs: dict[str, list[tuple[float, float, float, float]]],
           threads: int) -> list[str]:  # fmt: skip
    def steady(run: Run) -> float:  # steps/s of the units after the first (build and first-step costs left out)
        return shape.steps_per_unit / median(run.unit_seconds[1:])

    def whole(run: Run) -> float:
        return shape.steps / run.total

    def ratio(xs: list[float], base: list[float]) -> str:
        return f"{median(xs) / median(base):.2f}"

    import torch

    same = all(
        all(torch.equal(p.state[k], b.state[k]) for k in p.state)
        for p, b in zip(runs["product"], runs["bare"], strict=True)
    )
    base = runs["bare"]
    lines = [
        f"recipe `gpt` {shape.recipe_args or '(defaults)'}: {shape.steps} steps of global batch {shape.global_batch_size} "
        f"({shape.global_batch_size * shape.recipe_args.get('block_size', 64)} tokens) in {shape.grad_accumulation} "
        f"micro-batches, clip 1.0, bf16 autocast on the CPU, {threads} torch thread(s) (so that other processes on the "
        f"shared cores slow every variant alike instead of stalling a thread barrier); product units of "
        f"{shape.steps_per_unit} steps, each checkpointed to a local folder; {len(base)} alternating repetitions, "
        "medians (min-max).",
        "",
        "| in one process | steps/s, steady units | vs bare | steps/s, whole run | vs bare | CPU s, whole run | vs bare "
        "| checkpoint s/unit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rs in runs.items():
        st, wh, cpu = [steady(r) for r in rs], [whole(r) for r in rs], [r.cpu_seconds for r in rs]
        ckpt = spread([median(r.checkpoint_seconds) for r in rs], "{:.3f}") if rs[0].checkpoint_seconds else "-"
        lines.append(
            f"| {name} | {spread(st, '{:.1f}')} | {ratio(st, [steady(r) for r in base])} | {spread(wh, '{:.1f}')} "
            f"| {ratio(wh, [whole(r) for r in base])} | {spread(cpu, '{:.1f}')} "
            f"| {ratio(cpu, [r.cpu_seconds for r in base])} | {ckpt} |"
        )
    lines += [
        "",
        "Steady: units 2..n (the product's take the state the previous unit committed, in memory); whole run: build "
        "+ every unit (+ its checkpoint). Product and bare trained the same thing: final weights "
        f"{'bit-identical (torch.equal) in every repetition' if same else 'DIFFER'}; unit losses "
        f"{', '.join(f'{x:.4f}' for x in runs['product'][0].losses)} (product) vs "
        f"{', '.join(f'{x:.4f}' for x in base[0].losses)} (bare).",
        "",
        "| whole process | wall s | vs bare | CPU s (the process and a server it started) | vs bare | before the flow s | after the flow s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    bare_walls, bare_cpu = [t[0] for t in procs["bare python -c"]], [t[1] for t in procs["bare python -c"]]
    for name, ts in procs.items():
        walls, cpu = [t[0] for t in ts], [t[1] for t in ts]
        before = spread([t[2] for t in ts]) if ts[0][2] else "-"
        after = spread([t[3] for t in ts]) if ts[0][2] else "-"
        lines.append(
            f"| {name} | {spread(walls)} | {ratio(walls, bare_walls)} | {spread(cpu)} | {ratio(cpu, bare_cpu)} "
            f"| {before} | {after} |"
        )
    lines += [
        "",
        "Whole processes: `python -m flows.train --recipe gpt` with the same steps, units and "
        f"`--eval_interval {shape.steps_per_unit}ba` (imports, Prefect, flow, shutdown; the running server was started "
        "once by this benchmark), against `python -c` running the bare loop (imports + the same steps, no "
        f"evaluation). Before / after the flow: from the process's start to the flow's first log line, and from its "
        f"`Finished in state` line to the process's exit. `nproc`: {os.cpu_count()}.",
    ]
    return lines


def main(argv: list[str]) -> None:
    p = parser("gpt", "The GPT recipe through the product's units vs a bare PyTorch loop; whole processes too.")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    p.add_argument("--steps-per-unit", type=int, default=50, help="steps per unit (and per timed chunk of bare)")
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--accumulation", type=int, default=4, help="grad_accumulation (micro-batches per step)")
    p.add_argument("--recipe-args", default="{}", help="JSON recipe_args for recipes.gpt (default: its defaults)")
    p.add_argument("--reps", type=int, default=4, help="alternating repetitions in one process")
    p.add_argument("--process-reps", type=int, default=2, help="alternating repetitions of the whole processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every variant (OMP_NUM_THREADS)")
    a = p.parse_args(argv)
    if a.steps % a.steps_per_unit or a.steps // a.steps_per_unit < 2 or a.batch % a.accumulation:
        p.error(
            "--steps must be a multiple of --steps-per-unit (2 units or more); --batch a multiple of --accumulation"
        )
    load = load_average()
    isolate_prefect()
    import torch

    torch.set_num_threads(a.threads)
    shape = Shape(a.steps, a.steps_per_unit, a.batch, a.accumulation, json.loads(a.recipe_args))
    runs = in_process(shape, a.reps)
    procs = whole_processes(shape, a.process_reps, a.threads)
    record(
        "GPT recipe (nanoGPT port): product units vs a bare PyTorch loop (issue 11)",
        report(shape, runs, procs, a.threads),
        load,
    )
