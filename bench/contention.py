"""What a snapshot's background work takes from training on the CPU, and through which door (issue 45).

Issue 45 asks that checksums and uploads run "where they cannot take the GIL from training" (another process). Two
measurements say whether the GIL is what training loses:

1. The GIL: each background operation of a snapshot on a state of ``--gb`` GB (the xxh3 checksum of the slot, a
   sha256 of it, ``torch.save`` streamed through the store's ``HashingWriter`` to a file, one plain write) runs alone
   in the main thread while a probe thread sleeps 0.5 ms in a loop; how late the probe wakes is how long it waited for
   the GIL. A training thread would wait as long.
2. Memory bandwidth: a 1-thread torch workload shaped like a step (matmuls, then an optimizer-like pass over ``--gb``
   GB) runs alone and beside another *process* doing a Python busy loop (a core, no memory traffic), a loop of 1 GB
   copies, or a loop of xxh3 over 1 GB (the checksum's traffic); alternating, medians; the ratio to alone.

    python -m bench contention [--gb 1.0] [--reps 3]

Nothing of the product is changed; the HashingWriter is the store's own (checkpointing/commit/streaming.py).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import load_average, median, parser, progress, record, rotated, spread

PROBE_SLEEP = 0.0005
LATE = 0.005  # a wait longer than Python's switch interval: the GIL was held by C code that did not let go


def gil_waits(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """``fn``'s wall seconds, and the probe's longest and summed waits (> LATE) while it ran, in seconds."""
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(PROBE_SLEEP)
            waits.append(time.perf_counter() - t - PROBE_SLEEP)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    return wall, max(waits, default=0.0), sum(w for w in waits if w > LATE)


def part_gil(gb: float, reps: int, folder: Path) -> list[str]:
    import xxhash

    from checkpointing.commit.streaming import HashingWriter

    n = int(gb * 1e9) // 4
    tensors = [torch.randn(n // 300) for _ in range(300)]  # a GPT-like state: a few hundred tensors
    flat = torch.cat(tensors)
    view = flat.numpy().data.cast("B")

    def save_streamed() -> None:
        with open(folder / "state.pt", "wb") as f:
            torch.save({"state": tensors}, HashingWriter(f))  # type: ignore[arg-type]

    def write() -> None:
        with open(folder / "plain.bin", "wb") as f:
            f.write(view)

    ops: dict[str, Callable[[], Any]] = {
        "xxh3-128 of the slot (the tier's record)": lambda: xxhash.xxh3_128_hexdigest(view),
        "sha256 of the slot": lambda: hashlib.sha256(view).hexdigest(),
        "torch.save streamed through HashingWriter (the upload)": save_streamed,
        "one write of the bytes to a file": write,
    }
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in ops}
    for rep in range(reps):
        for name in rotated(list(ops), rep):
            rows[name].append(gil_waits(ops[name]))
            progress(f"GIL rep {rep + 1}/{reps}: {name}: wall {rows[name][-1][0]:.2f} s")
    lines = [
        f"1. The GIL, {gb:g} GB state ({len(tensors)} tensors), {reps} alternating reps, medians (min-max): a probe "
        f"thread sleeping {PROBE_SLEEP * 1e3:g} ms in a loop while the operation runs in the main thread; its "
        f"waits longer than {LATE * 1e3:g} ms are time a training thread would have waited for the GIL.",
        "",
        "| operation | wall s | longest GIL wait ms | GIL waits > 5 ms, summed s |",
        "| --- | --- | --- | --- |",
    ]
    for name, xs in rows.items():
        walls, longest, summed = ([x[i] for x in xs] for i in range(3))
        lines.append(
            f"| {name} | {spread(walls)} | {spread([x * 1e3 for x in longest], '{:.1f}')} | {spread(summed)} |"
        )
    return lines


WORKLOAD = """
import sys, time, torch
torch.set_num_threads(1)
a, x = torch.randn(768, 768), torch.randn(256, 768)
state = torch.randn(int(float(sys.argv[1]) * 1e9) // 4)
def step():
    t = time.perf_counter()
    for _ in range(200):
        x @ a
    state.mul_(0.999)  # an optimizer's pass over the state
    return time.perf_counter() - t
step()
print(sorted(step() for _ in range(int(sys.argv[2])))[int(sys.argv[2]) // 2])
"""
BESIDE = {
    "nothing": None,
    "a Python busy loop (a core, no memory traffic)": "while True: pass",
    "1 GB copies in a loop": "import torch\na, b = torch.empty(250_000_000), torch.ones(250_000_000)\n"
    "while True: a.copy_(b)",
    "xxh3-128 of 1 GB in a loop": "import torch, xxhash\na = torch.ones(250_000_000).numpy()\n"
    "while True: xxhash.xxh3_128_hexdigest(memoryview(a).cast('B'))",
}


def part_bandwidth(gb: float, reps: int) -> list[str]:
    times: dict[str, list[float]] = {k: [] for k in BESIDE}
    for rep in range(reps):
        for name in rotated(list(BESIDE), rep):
            code = BESIDE[name]
            other = subprocess.Popen([sys.executable, "-c", code]) if code else None
            try:
                time.sleep(1.5 if other else 0)  # the other process at full speed first
                out = subprocess.run([sys.executable, "-c", WORKLOAD, str(gb), "5"], capture_output=True, text=True,
                                     check=True, timeout=600)  # fmt: skip
            finally:
                if other is not None:
                    other.kill()
                    other.wait()
            times[name].append(float(out.stdout))
            progress(f"bandwidth rep {rep + 1}/{reps}: beside {name}: {times[name][-1] * 1e3:.0f} ms a step")
    alone = times["nothing"]
    lines = [
        f"2. Memory bandwidth: a 1-thread step (200 matmuls of 256x768 by 768x768, then a pass over {gb:g} GB) in a "
        f"process of its own, median of 5 steps, beside another process; {reps} alternating reps, medians (min-max).",
        "",
        "| beside | ms a step | vs alone |",
        "| --- | --- | --- |",
    ]
    for name, xs in times.items():
        ratio = median([x / a for x, a in zip(xs, alone, strict=True)])
        lines.append(f"| {name} | {spread([x * 1e3 for x in xs], '{:.0f}')} | {ratio:.2f}x |")
    return lines


def main(argv: list[str]) -> None:
    p = parser("contention", __doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="the state's size in GB")
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions")
    p.add_argument("--note", default="", help="a sentence added to the record (what else ran, say)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    load = load_average()
    with tempfile.TemporaryDirectory(prefix="contention-") as folder:
        lines = [*part_gil(a.gb, a.reps, Path(folder)), "", *part_bandwidth(a.gb, a.reps)]
    if a.note:
        lines += ["", a.note]
    record("Issue 45: what a snapshot's background work takes from training (cpu)", lines, load)


if __name__ == "__main__":
    main(sys.argv[1:])
