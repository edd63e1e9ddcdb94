"""What metrics where people look cost (issue 36): TensorBoard event files on (the default) against off.

In one process, alternating, the same units through ``training.unit.loop.run_unit`` with ``tensorboard`` true and
false, for two step sizes:

* ``small``: the synthetic recipe with a tiny model, a few milliseconds a step, where a per-step cost shows most;
* ``gpt``: the GPT recipe (the nanoGPT port) at its benchmark size, a step as a small real model takes on a CPU.

The figure is the time per step, on / off (units' wall time over their steps). Then whole processes, alternating:
``python -m flows.train`` with and without ``--tensorboard false`` against a running Prefect server (the first event
file's imports are part of what a user waits for).
"""

from __future__ import annotations

import time

from bench import whole
from bench.common import isolate_prefect, load_average, median, parser, progress, record, rotated, scratch, spread

SHAPES = {
    "small": dict(recipe="synthetic", recipe_args={"num_samples": 4096, "hidden": 32}, batch=32, steps=384, unit=64),
    "gpt": dict(recipe="gpt", recipe_args={}, batch=8, steps=48, unit=16),
}


def per_step(shape: dict, tensorboard: bool) -> float:
    """Seconds per step of ``shape``'s units, with event files on or off (a fresh run folder each time)."""
    from training.config import TrainConfig
    from training.metrics import log as metrics_log
    from training.unit.loop import run_unit
    from training.unit.warm import SessionCache

    config = TrainConfig(
        run_name="metrics", save_folder=scratch("metrics-"), recipe=shape["recipe"], recipe_args=shape["recipe_args"],
        max_duration=f"{shape['steps']}ba", save_interval=f"{shape['unit']}ba", global_batch_size=shape["batch"],
        tensorboard=tensorboard, progress_bar=False, host_memory_tier=False,
    )  # fmt: skip
    cache, start, seconds, steps = SessionCache(), None, 0.0, 0
    while True:
        t0 = time.perf_counter()
        result = run_unit(config, start_checkpoint=start, cache=cache)
        if start is not None:  # the first unit builds the model and opens the writer: counted by the whole process
            seconds, steps = seconds + time.perf_counter() - t0, steps + shape["unit"]
        start = result.checkpoint_name
        if result.complete:
            break
    cache.forget()
    metrics_log.close_all()
    return seconds / steps


def whole_process(tensorboard: bool, api_url: str) -> float:
    cmd = whole.python("-m", "flows.train", "--recipe", "synthetic", "--recipe_args", '{"num_samples": 2048}',
                       "--max_duration", "2ep", "--global_batch_size", "32", "--run_name", "metrics",
                       "--save_folder", scratch("metrics-whole-"), "--tensorboard", str(tensorboard).lower())  # fmt: skip
    return whole.run(cmd, whole.child_env(2, PREFECT_API_URL=api_url)).wall


def main(argv: list[str]) -> None:
    p = parser("metrics", __doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions of each variant")
    p.add_argument("--process-reps", type=int, default=4, help="alternating whole-process repetitions")
    args = p.parse_args(argv)
    load = load_average()
    isolate_prefect()
    import torch

    torch.set_num_threads(1)
    lines = ["| steps | TensorBoard on: s/step | off: s/step | on / off |", "| --- | --- | --- | --- |"]
    for name, shape in SHAPES.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps):
            for on in rotated([True, False], rep):
                progress(f"{name} rep {rep} tensorboard={on}")
                times[on].append(per_step(shape, on))
        ratio = median(times[True]) / median(times[False])
        lines.append(f"| {name} | {spread(times[True], '{:.4f}')} | {spread(times[False], '{:.4f}')} | {ratio:.3f}x |")
    walls: dict[bool, list[float]] = {True: [], False: []}
    whole.compile_bytecode()
    with whole.held_server() as api_url:
        for rep in range(args.process_reps):
            for on in rotated([True, False], rep):
                progress(f"whole process rep {rep} tensorboard={on}")
                walls[on].append(whole_process(on, api_url))
    lines += [
        "",
        "| whole `python -m flows.train` (synthetic, 2 epochs, running server) | TensorBoard on | off | on / off |",
        "| --- | --- | --- | --- |",
        f"| wall seconds | {spread(walls[True])} | {spread(walls[False])} | "
        f"{median(walls[True]) / median(walls[False]):.3f}x |",
    ]
    record("Metrics: TensorBoard event files on vs off (issue 36)", lines, load)
