"""CLI start-up: wall time of `python -m checkpointing ls <local run>` against `python -c "import torch"` and
`python -c pass`.

A person listing checkpoints should not wait for torch or Prefect to import: ``ls`` and ``verify`` read JSON
manifests and hash bytes, and the checkpointing package imports torch only where a checkpoint is serialized
or loaded. Each variant is a fresh interpreter; the variants alternate (each repetition starts one later)
and medians are reported, so the ratios come from the same minutes of a shared machine. Goal: ``ls`` of a
local run in under 2 s here.
"""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import load_average, median, parser, progress, record, rotated, scratch, spread

GOAL_SECONDS = 2.0


def _local_run(num_checkpoints: int) -> str:
    """A run folder with ``num_checkpoints`` small committed checkpoints; its URI."""
    import torch

    from checkpointing import CheckpointStore, Writer

    store = CheckpointStore(scratch("cli-"), "exp")
    for i in range(num_checkpoints):
        step = 8 * (i + 1)
        store.save(
            f"ep{i + 1}-ba{step}-sa{32 * step}",
            {"state.pt": {"state": {"model": {"w": torch.randn(256, 256)}}}},
            progress={"epoch": i + 1, "step": step, "samples_seen": 32 * step},
            writer=Writer.current(1),
        )
    return store.uri


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _imported(cmd: list[str]) -> set[str]:
    """Top-level packages ``cmd`` (a python command) imports, from ``-X importtime``."""
    out = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True, check=True)
    lines = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines}


def main(argv: list[str]) -> None:
    p = parser("cli", "python -m checkpointing ls <local run> vs python -c 'import torch' vs python -c pass.")
    p.add_argument("--reps", type=int, default=10, help="repetitions (alternating variants), medians reported")
    p.add_argument("--checkpoints", type=int, default=20, help="checkpoints in the listed run")
    a = p.parse_args(argv)
    load = load_average()
    uri = _local_run(a.checkpoints)
    variants = {
        "python -m checkpointing ls <run>": [sys.executable, "-m", "checkpointing", "ls", uri],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "python -c pass": [sys.executable, "-c", "pass"],
    }
    _wall(variants["python -m checkpointing ls <run>"])  # warm the page cache once, for every variant alike
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(a.reps):
        for name in rotated(list(variants), rep):
            times[name].append(_wall(variants[name]))
        progress(f"rep {rep + 1}/{a.reps}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
    heavy = _imported(variants["python -m checkpointing ls <run>"]) & {"torch", "prefect", "numpy"}
    ls, torch_import, bare = (median(times[n]) for n in variants)
    lines = [
        f"A local run of {a.checkpoints} committed checkpoints (one 256 KB tensor each); {a.reps} alternating "
        "repetitions, each a fresh interpreter; wall time, medians (min-max).",
        "",
        "| command | wall time, s | ls / this |",
        "| --- | --- | --- |",
        *(f"| `{n}` | {spread(times[n])} | {ls / median(times[n]):.2f} |" for n in variants),
        "",
        f"`ls` takes {ls:.2f} s: {ls / torch_import:.2f}x the time of importing torch alone and "
        f"{ls / bare:.1f}x a bare interpreter start (goal < {GOAL_SECONDS:.0f} s: "
        f"{'met' if ls < GOAL_SECONDS else 'missed'}). Heavy packages `ls` imported: "
        f"{', '.join(sorted(heavy)) or 'none of torch, prefect, numpy'}.",
    ]
    record("CLI start-up: python -m checkpointing ls", lines, load)
