"""Streaming shards (issue 34): what reading through training.data.ShardedDataset costs against reading the same shards
with plain numpy / pyarrow, how long a resume waits for its first batch at 10 % and at 90 % of an epoch, what the cache
holds, and what loader workers cost when a run is cut into units.

1. Reader throughput, side by side, alternating, medians: the same token shards (``--shards`` x ``--shard-mb`` MB of
   uint16 on local disk, ``--block`` tokens a sample) and the same Parquet shards, visited in the same order (the
   epoch's windowed shuffle) and batched by 32 with the default collate: ``ShardedDataset`` against ``np.memmap`` of
   each file sliced by hand (tokens) and ``pyarrow.parquet.read_table`` + row slices (Parquet). Goal >= 0.9x.
2. Time to the first batch after a resume at 10 % and at 90 % of the epoch (a fresh sampler and DataLoader at that
   position): flat means the ratio 90 %/10 % is near 1 (no fast-forward by iteration).
3. From a bucket (moto's S3 server in a child process): the token shards read through a cache of ``--cache-mb`` MB, a
   quarter of the data: the cache folder's largest size seen, and the reading process's peak RSS growth.
4. Whole commands (``python -m flows.train``, a Prefect server held by this benchmark), alternating, medians: the
   synthetic recipe with ``--num_workers 2``, 4 epochs as 4 one-epoch units against one 4-epoch unit. Goal <= 1.05x.
"""

from __future__ import annotations

import bisect
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import load_average, parser, progress, record, rotated, scratch, spread

GOAL_READ = 0.9
GOAL_UNITS = 1.05


def write_tokens(folder: str, shards: int, shard_mb: int, block: int) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = shard_mb * (1 << 20) // 2
    for j in range(shards):
        rng.integers(0, 50257, tokens, dtype=np.uint16).tofile(os.path.join(folder, f"train-{j:03d}.bin"))


def write_parquet(folder: str, shards: int, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    for j in range(shards):
        ids = np.arange(j * rows, (j + 1) * rows)
        table = pa.table({"id": ids, "text": [f"sample {i} " * 8 for i in ids]})
        pq.write_table(table, os.path.join(folder, f"part-{j:03d}.parquet"), row_group_size=1024)


def batches(order: list[int], n: int = 32) -> list[list[int]]:
    return [order[i : i + n] for i in range(0, len(order), n)]


def read_product(ds, order: list[int]) -> float:
    from torch.utils.data import default_collate

    t0 = time.perf_counter()
    for ids in batches(order):
        default_collate(ds.__getitems__(ids))  # what the DataLoader's fetcher calls for a batch
    return time.perf_counter() - t0


def read_numpy_tokens(folder: str, index, block: int, order: list[int]) -> float:
    """The baseline: each shard memory-mapped with numpy, sample k sliced by hand, the same collate."""
    import torch
    from torch.utils.data import default_collate

    t0 = time.perf_counter()
    maps = {s.name: np.memmap(os.path.join(folder, s.name), dtype=np.uint16, mode="r") for s in index.shards}
    starts = index.starts
    names = [s.name for s in index.shards]
    for ids in batches(order):
        items = []
        for i in ids:
            j = bisect.bisect_right(starts, i) - 1  # the same addressing as the product's index
            k = i - starts[j]
            chunk = torch.from_numpy(maps[names[j]][k * block : (k + 1) * block + 1].astype(np.int64))
            items.append((chunk[:-1], chunk[1:]))
        default_collate(items)
    return time.perf_counter() - t0


def read_pyarrow(folder: str, index, order: list[int]) -> float:
    import pyarrow.parquet as pq
    from torch.utils.data import default_collate

    t0 = time.perf_counter()
    tables = {}
    starts = index.starts
    names = [s.name for s in index.shards]
    for ids in batches(order):
        items = []
        for i in ids:
            j = bisect.bisect_right(starts, i) - 1
            if j not in tables:
                tables[j] = pq.read_table(os.path.join(folder, names[j]))
            items.append(tables[j].slice(i - starts[j], 1).to_pylist()[0])
        default_collate(items)
    return time.perf_counter() - t0


def first_batch_seconds(ds, fraction: float) -> float:
    from torch.utils.data import DataLoader

    from training.position.sampler import ResumableBatchSampler

    t0 = time.perf_counter()
    start = int(len(ds) * fraction)
    sampler = ResumableBatchSampler(len(ds), 32, seed=1, epoch=3, start=start, order=ds.epoch_order)
    next(iter(DataLoader(ds, batch_sampler=sampler)))
    return time.perf_counter() - t0


CACHE_PROBE = """
import os, resource, sys, threading, time, json
from training.data import ShardedDataset
url, options, cache, cache_bytes = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
largest = [0]
done = threading.Event()
def watch():
    while not done.is_set():
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs
                   if os.path.exists(os.path.join(d, f)))
        largest[0] = max(largest[0], size)
        time.sleep(0.01)
def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
ds = ShardedDataset(url, "tokens", block_size=1024, storage_options=options, cache_dir=cache, cache_bytes=cache_bytes)
threading.Thread(target=watch, daemon=True).start()
before = rss()
peak = dict(before)
t0 = time.perf_counter()
order = ds.epoch_order(1, 0)
ids = order[:].tolist()
for b in range(0, len(ids), 32):
    ds.__getitems__(ids[b : b + 32])
    if b % 3200 == 0:
        now = rss()
        peak = {k: max(peak[k], now[k]) for k in now}
seconds = time.perf_counter() - t0
done.set()
print(json.dumps({"largest": largest[0], "anon_growth": peak["RssAnon"] - before["RssAnon"],
                  "file_peak": peak["RssFile"] - before["RssFile"], "seconds": seconds, "samples": len(ds)}))
"""


def main(argv: list[str]) -> None:
    p = parser("streaming", __doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--shard-mb", type=int, default=16)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--parquet-rows", type=int, default=20_000)
    p.add_argument("--cache-mb", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--unit-reps", type=int, default=5)
    p.add_argument("--skip-units", action="store_true", help="skip part 4 (whole commands)")
    args = p.parse_args(argv)
    load_at_start = load_average()
    from training.data import ShardedDataset

    root = scratch("streaming-")
    tokens, parquet = os.path.join(root, "tokens"), os.path.join(root, "parquet")
    write_tokens(tokens, args.shards, args.shard_mb, args.block)
    write_parquet(parquet, args.shards, args.parquet_rows)
    progress("shards written")
    tok = ShardedDataset(tokens, "tokens", block_size=args.block)
    pqt = ShardedDataset(parquet, "parquet")
    tok_order = tok.epoch_order(1, 0)[:].tolist()
    pq_order = pqt.epoch_order(1, 0)[:].tolist()
    times: dict[str, list[float]] = {k: [] for k in ("tok", "np", "pq", "arrow")}
    variants = ["tok", "np", "pq", "arrow"]
    for rep in range(args.reps):
        for v in rotated(variants, rep):
            if v == "tok":
                fresh = ShardedDataset(tokens, "tokens", block_size=args.block)
                times[v].append(read_product(fresh, tok_order))
            elif v == "np":
                times[v].append(read_numpy_tokens(tokens, tok.index, args.block, tok_order))
            elif v == "pq":
                times[v].append(read_product(ShardedDataset(parquet, "parquet"), pq_order))
            else:
                times[v].append(read_pyarrow(parquet, pqt.index, pq_order))
        progress(f"read rep {rep + 1}/{args.reps}")
    ratio_tok = [b / a for a, b in zip(times["tok"], times["np"], strict=True)]
    ratio_pq = [b / a for a, b in zip(times["pq"], times["arrow"], strict=True)]

    first: dict[float, list[float]] = {0.1: [], 0.9: []}
    for rep in range(args.reps):
        for fraction in rotated([0.1, 0.9], rep):
            first[fraction].append(
                first_batch_seconds(ShardedDataset(tokens, "tokens", block_size=args.block), fraction)
            )
    flat = [b / a for a, b in zip(first[0.1], first[0.9], strict=True)]

    cache_lines = cache_probe(tokens, args)
    unit_lines = [] if args.skip_units else units(args.unit_reps)

    n_tok, n_pq = len(tok), len(pqt)
    mb = args.shards * args.shard_mb
    lines = [
        f"Token shards: {args.shards} x {args.shard_mb} MB uint16 ({n_tok} samples of {args.block} tokens); Parquet: "
        f"{args.shards} x {args.parquet_rows} rows (id, text), row groups of 1024; local disk, page cache warm; "
        f"{args.reps} alternating reps, medians (min-max).",
        "",
        "| | ShardedDataset | plain numpy / pyarrow | throughput ratio (goal >= 0.9x) |",
        "|---|---|---|---|",
        f"| tokens, {mb} MB | {spread(times['tok'])} s ({n_tok / statistics.median(times['tok']):.0f} samples/s) | "
        f"{spread(times['np'])} s | {spread(ratio_tok)}x |",
        f"| Parquet | {spread(times['pq'])} s ({n_pq / statistics.median(times['pq']):.0f} rows/s) | "
        f"{spread(times['arrow'])} s | {spread(ratio_pq)}x |",
        "",
        f"Time to the first batch after a resume (fresh dataset, sampler and DataLoader): at 10 % of the epoch "
        f"{spread(first[0.1], '{:.3f}')} s, at 90 % {spread(first[0.9], '{:.3f}')} s; ratio 90 %/10 % "
        f"{spread(flat)}x (flat: no fast-forward).",
        "",
        *cache_lines,
        "",
        *unit_lines,
    ]
    record("Streaming shards: reader throughput, resume position, cache bound, workers across units", lines,
           load_at_start)  # fmt: skip


def cache_probe(tokens: str, args) -> list[str]:
    import json

    from bench.common import local_s3

    with local_s3() as s3:
        bucket = s3.fresh_bucket("stream")
        import fsspec

        fs = fsspec.filesystem("s3", **s3.options)
        fs.put(tokens + "/", f"{bucket.split('://')[1]}/tokens/", recursive=True)
        url = f"{bucket}/tokens"
        cache = tempfile.mkdtemp(prefix="cache-", dir=scratch("cache-"))
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        out = subprocess.run([sys.executable, "-c", CACHE_PROBE, url, json.dumps(s3.options), cache,
                              str(args.cache_mb << 20)], capture_output=True, text=True, env=env, timeout=1200)  # fmt: skip
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        got = json.loads(out.stdout.strip().splitlines()[-1])
    data_mb = args.shards * args.shard_mb
    return [
        f"From S3 (moto, loopback): {data_mb} MB of token shards read in epoch order through a {args.cache_mb} MB "
        f"cache: the cache folder held at most {got['largest'] / 2**20:.1f} MB; the reading process's resident memory "
        f"grew at most {got['anon_growth'] / 2**20:.0f} MB of its own (anonymous) and "
        f"{got['file_peak'] / 2**20:.0f} MB of mapped shards (open shards, closed beyond cache_bytes); "
        f"{got['samples'] / got['seconds']:.0f} samples/s "
        f"({data_mb / got['seconds']:.0f} MB/s, downloads included).",
    ]


def units(reps: int) -> list[str]:
    from bench import whole

    def flags(units: int, name: str, workers: int) -> list[str]:
        return ["--recipe", "synthetic", "--recipe_args", '{"num_samples": 8192}', "--global_batch_size", "64",
                "--max_duration", "4ep", "--save_interval", f"{4 // units}ep", "--num_workers", str(workers),
                "--run_name", name, "--save_folder", scratch("units-")]  # fmt: skip

    walls: dict[tuple[int, int], list[float]] = {}
    variants = [(4, 2), (1, 2), (4, 0), (1, 0)]
    with whole.held_server() as url:
        env = whole.child_env(2, PREFECT_API_URL=url)
        whole.run(whole.python("-m", "flows.train", *flags(1, "warm", 2)), env)
        for rep in range(reps):
            for n, workers in rotated(variants, rep):
                done = whole.run(whole.python("-m", "flows.train", *flags(n, f"r{rep}u{n}w{workers}", workers)), env)
                walls.setdefault((n, workers), []).append(done.wall)
                progress(f"units rep {rep + 1}/{reps}: {n} unit(s), {workers} workers: {done.wall:.1f} s")
    ratio = [a / b for a, b in zip(walls[(4, 2)], walls[(1, 2)], strict=True)]
    ratio0 = [a / b for a, b in zip(walls[(4, 0)], walls[(1, 0)], strict=True)]
    return [
        "Whole `python -m flows.train` commands (synthetic recipe, 8192 samples, batch 64, 4 epochs, Prefect server "
        f"held by the benchmark), {reps} alternating reps:",
        "",
        "| num_workers | 4 one-epoch units | one 4-epoch unit | ratio (goal <= 1.05x) |",
        "|---|---|---|---|",
        f"| 2 | {spread(walls[(4, 2)])} s | {spread(walls[(1, 2)])} s | {spread(ratio)}x |",
        f"| 0 (what a unit costs without workers) | {spread(walls[(4, 0)])} s | {spread(walls[(1, 0)])} s | "
        f"{spread(ratio0)}x |",
    ]


if __name__ == "__main__":
    main(sys.argv[1:])
