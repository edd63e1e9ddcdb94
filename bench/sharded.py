"""Sharded checkpoints and streamed saves (issue 15): peak memory during a save, and FSDP2 save/load time vs
world size.

1. Peak RSS during one save of the same ~200 MB state, each variant in a fresh process: the process's
   peak (VmHWM, reset through /proc/self/clear_refs once the state is built) minus its RSS before the
   state existed (after a tiny warm-up state, so that autograd's lazy set-up is not counted), divided by
   the state's tensor bytes. 1.0 means the save held nothing beyond the state.
       today      CheckpointStore.save: torch.save into BytesIO, getvalue(), then commit writes the bytes
       streaming  checkpointing.commit.streaming.save_streaming: torch.save into the store's file handle, hashed
       dcp        checkpointing.commit.sharded.save_state: DCP shards of the same state, one process
2. FSDP2 (fully_shard, gloo, CPU) save and load of a fixed MLP with Adam at world size 1 and 2, under
   torchrun: wall time of save_sharded / load_sharded (slowest rank), and each rank's own peak during save.

Variants alternate (each repetition starts one later); medians with min-max.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

from bench.common import load_average, local_s3, median, parser, progress, record, rotated, scratch, spread

VARIANTS = ["today", "streaming", "dcp"]


# -- in a child process ---------------------------------------------------------------------------
def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def child_rss(variant: str, folder: str, hidden: int, layers: int) -> dict:
    """One save in this fresh process; its memory figures."""
    import gc

    from bench.store_throughput import checkpoint_objects
    from checkpointing import CheckpointStore, Writer
    from checkpointing.commit import sharded
    from checkpointing.commit.streaming import save_streaming, tensor_bytes

    options = json.loads(os.environ.get("BENCH_STORAGE_OPTIONS", "{}"))  # the endpoint, never argv
    store = CheckpointStore(folder, f"m{uuid.uuid4().hex[:8]}", storage_options=options)
    store.storage.exists("latest")  # opens connections before the baseline
    checkpoint_objects(64, 2)  # autograd and the optimizer initialize lazily (~50 MB): not part of the state
    gc.collect()
    before = _kib("VmRSS")
    objects = checkpoint_objects(hidden, layers)
    state_bytes = tensor_bytes(objects)
    gc.collect()
    with_state = _kib("VmRSS")
    _reset_peak()
    t0, position, writer = time.perf_counter(), {"samples_seen": 1}, Writer.current(1)
    if variant == "today":
        store.save("c", objects, progress=position, writer=writer)
    elif variant == "streaming":
        save_streaming(store, "c", objects, progress=position, writer=writer)
    else:
        rng_file = {"rng-rank0.pt": objects["rng-rank0.pt"]}
        sharded.save_state(store, "c", objects["state.pt"], files=rng_file, progress=position, writer=writer)
    seconds = time.perf_counter() - t0
    peak = _kib("VmHWM")
    return {
        "state_mb": state_bytes / 1e6,
        "peak_ratio": (peak - before) / state_bytes,
        "extra_ratio": (peak - with_state) / state_bytes,
        "seconds": seconds,
    }


def child_fsdp(plan_file: str) -> None:
    """One rank: build, shard, one step (Adam state exists), then timed save + load pairs."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from checkpointing import CheckpointStore, Writer
    from checkpointing.commit.committer import CommitTerms
    from training.unit import fsdp

    with open(plan_file) as f:
        plan = json.load(f)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = json.loads(os.environ.get("BENCH_STORAGE_OPTIONS", "{}"))
    store = CheckpointStore(plan["folder"], plan["run"], storage_options=options)
    torch.manual_seed(0)
    width = plan["hidden"]
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(plan["layers"])])
    fsdp.shard_model(model, torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    out = []
    for i in range(plan["pairs"]):
        dist.barrier()
        _reset_peak()
        before, t0 = _kib("VmRSS"), time.perf_counter()
        terms = CommitTerms(store, {"epoch": 0, "step": i + 1, "samples_seen": i + 1}, Writer.current(0))
        info = fsdp.save_sharded(terms, model, optimizer, {"step": i + 1}).wait()
        save_s, save_peak = time.perf_counter() - t0, _kib("VmHWM") - before
        dist.barrier()
        t0 = time.perf_counter()
        fsdp.load_sharded(store, info, model, optimizer)
        load_s = time.perf_counter() - t0
        out.append({"save": save_s, "load": load_s, "save_extra": save_peak, "bytes": info.size_bytes})
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        with open(plan["result"], "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


# -- the benchmark --------------------------------------------------------------------------------
def _rss_runs(folder: str, options: dict | None, a) -> dict[str, list[dict]]:
    env = {**os.environ, "BENCH_STORAGE_OPTIONS": json.dumps(options or {}), "OMP_NUM_THREADS": "1"}
    out: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(a.reps):
        for variant in rotated(VARIANTS, rep):
            cmd = [sys.executable, "-m", "bench.sharded", "child-rss", variant, folder, str(a.hidden), str(a.layers)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
            out[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            progress(f"rss {variant} rep {rep}: {out[variant][-1]}")
    return out


def _fsdp_runs(folder: str, a) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {1: [], 2: []}
    for rep in range(a.reps):
        for world in rotated([1, 2], rep):
            with tempfile.TemporaryDirectory() as tmp:
                plan = {
                    "folder": folder,
                    "run": f"w{world}-{rep}",
                    "hidden": a.fsdp_hidden,
                    "layers": a.fsdp_layers,
                    "pairs": a.pairs,
                    "result": f"{tmp}/result.json",
                }
                with open(f"{tmp}/plan.json", "w") as f:
                    json.dump(plan, f)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
                subprocess.run([*cmd, "-m", "bench.sharded", "child-fsdp", f"{tmp}/plan.json"], check=True, timeout=600)
                with open(plan["result"]) as f:
                    ranks = json.load(f)
            for pair in range(a.pairs):  # a pair's time is its slowest rank's
                rows = [r[pair] for r in ranks]
                out[world].append(
                    {
                        "save": max(r["save"] for r in rows),
                        "load": max(r["load"] for r in rows),
                        "save_extra": max(r["save_extra"] for r in rows),
                        "bytes": rows[0]["bytes"],
                    }
                )
            progress(f"fsdp world {world} rep {rep}: {out[world][-a.pairs :]}")
    return out


def _rss_table(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    labels = {
        "today": "today: `CheckpointStore.save` (bytes in memory, then written)",
        "streaming": "streaming: `save_streaming` (torch.save into the file handle, hashed)",
        "dcp": "DCP: `sharded.save_state`, 1 process",
    }
    lines = [
        "| store | save | peak RSS / state | extra during save / state | save s | goal <= 1.3x |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for store, by_variant in results.items():
        for variant in VARIANTS:
            runs = by_variant[variant]
            peak = median([r["peak_ratio"] for r in runs])
            lines.append(
                f"| {store} | {labels[variant]} | {spread([r['peak_ratio'] for r in runs])} | "
                f"{spread([r['extra_ratio'] for r in runs])} | {spread([r['seconds'] for r in runs])} | "
                f"{'met' if peak <= 1.3 else 'missed'} |"
            )
    return lines


def _fsdp_table(out: dict[int, list[dict]]) -> list[str]:
    size = out[1][0]["bytes"]
    lines = [
        f"FSDP2 (fully_shard per layer + root, gloo, CPU), checkpoint {size / 1e6:.0f} MB (model + Adam moments), "
        "local folder; a pair's figure is its slowest rank's.",
        "",
        "| world size | save s | load s | per-rank extra RSS during save / checkpoint size |",
        "| --- | --- | --- | --- |",
    ]
    for world, rows in out.items():
        lines.append(
            f"| {world} | {spread([r['save'] for r in rows])} | {spread([r['load'] for r in rows])} | "
            f"{spread([r['save_extra'] / size for r in rows])} |"
        )
    return lines


def main(argv: list[str]) -> None:
    p = parser("sharded", __doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=3584, help="width of the synthetic MLP of the peak-RSS state")
    p.add_argument("--layers", type=int, default=4, help="layers of that MLP (3584 x 4: ~200 MB with momentum)")
    p.add_argument("--fsdp-hidden", type=int, default=2048, help="width of the FSDP MLP (Linear layers)")
    p.add_argument("--fsdp-layers", type=int, default=4, help="Linear layers of the FSDP MLP (2048 x 4: ~200 MB)")
    p.add_argument("--pairs", type=int, default=2, help="save + load pairs per torchrun launch")
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions, median reported")
    p.add_argument("--no-s3", action="store_true", help="peak RSS on the local folder only")
    a = p.parse_args(argv)
    load = load_average()
    rss = {"local folder": _rss_runs(scratch("rss-"), None, a)}
    if not a.no_s3:
        with local_s3() as s3:
            rss["S3 over HTTP (moto)"] = _rss_runs(f"{s3.fresh_bucket('bench-rss')}/runs", s3.options, a)
    fsdp_out = _fsdp_runs(scratch("fsdp-"), a)
    state_mb = rss["local folder"]["today"][0]["state_mb"]
    lines = [
        f"Peak RSS during one save of the synthetic MLP {a.hidden} x {a.layers} with SGD momentum "
        f"({state_mb:.0f} MB of tensors), each save in a fresh process, {a.reps} alternating repetitions: "
        "(peak RSS - RSS before the state was built) / state bytes; 'extra' leaves the state itself out.",
        "",
        *_rss_table(rss),
        "",
        *_fsdp_table(fsdp_out),
    ]
    record("Sharded checkpoints and streamed saves (issue 15)", lines, load)


if __name__ == "__main__":
    if sys.argv[1] == "child-rss":
        print(json.dumps(child_rss(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    elif sys.argv[1] == "child-fsdp":
        child_fsdp(sys.argv[2])
