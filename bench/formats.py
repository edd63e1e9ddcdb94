"""Other tools' shard formats (issue 48): reading MosaicML MDS and WebDataset tars through
``training.data.ShardedDataset`` against the peers' own readers on the same files, samples/s in one run, alternating,
medians. Goal >= 0.9x.

- MDS: ``--samples`` samples (``id`` int, ``tokens`` ndarray of ``--block`` + 1 uint16, ``text`` str) written by
  ``streaming.MDSWriter`` in ``--shard-mb`` MB shards, uncompressed and zstd; read whole by ``ShardedDataset(url,
  "mds")`` in its epoch order (windowed shuffle), a batch of 32 at a time, against ``streaming.StreamingDataset(local=
  ..., shuffle=True)`` iterated (its own shuffle). Needs mosaicml-streaming, which does not install beside the
  product's pins: run this benchmark with a Python that has it (tests/fixtures/mds/make_fixture.py says how);
  without it the MDS rows are left out.
- WebDataset: the same samples (``tokens.npy``, ``txt``, ``cls``, ``json``) by ``webdataset.ShardWriter``; read by
  ``ShardedDataset(url, "webdataset")`` in its epoch order against ``webdataset.WebDataset(urls).decode()`` iterated in
  tar order (a stream, no shuffle: the peer's cheapest read).

Both sides decode every column; times include opening the dataset (the product's shard index already written, as on
any run after the first).
"""

from __future__ import annotations

import glob
import os
import statistics
import time

import numpy as np

from bench.common import load_average, parser, progress, record, rotated, scratch, spread

GOAL = 0.9


def sample(g: int, block: int) -> dict:
    return {"id": g, "tokens": np.full(block + 1, g % 60000, np.uint16), "text": f"sample {g} " * 4}


def write_mds(folder: str, n: int, block: int, shard_mb: int, compression: str | None) -> None:
    from streaming import MDSWriter

    columns = {"id": "int", "tokens": f"ndarray:uint16:{block + 1}", "text": "str"}
    with MDSWriter(out=folder, columns=columns, size_limit=shard_mb << 20, compression=compression) as out:
        for g in range(n):
            out.write(sample(g, block))


def write_wds(folder: str, n: int, block: int, shard_mb: int) -> None:
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(folder, "part-%05d.tar"), maxsize=shard_mb << 20, verbose=0) as sink:
        for g in range(n):
            s = sample(g, block)
            sink.write({"__key__": f"{g:08d}", "tokens.npy": s["tokens"], "txt": s["text"], "cls": g, "json": {"g": g}})


def ours(folder: str, fmt: str) -> tuple[float, int]:
    from training.data import ShardedDataset

    t0 = time.perf_counter()
    ds = ShardedDataset(folder, fmt)
    order = ds.epoch_order(1, 0)[:].tolist()
    n = 0
    for b in range(0, len(order), 32):
        n += len(ds.__getitems__(order[b : b + 32]))
    return time.perf_counter() - t0, n


def streaming_peer(folder: str) -> tuple[float, int]:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    t0 = time.perf_counter()
    ds = StreamingDataset(local=folder, shuffle=True, batch_size=32)
    n = sum(1 for _ in ds)
    return time.perf_counter() - t0, n


def webdataset_peer(folder: str) -> tuple[float, int]:
    import webdataset as wds

    t0 = time.perf_counter()
    urls = sorted(glob.glob(os.path.join(folder, "*.tar")))
    n = sum(1 for _ in wds.WebDataset(urls, shardshuffle=False).decode())
    return time.perf_counter() - t0, n


def main(argv: list[str]) -> None:
    p = parser("formats", __doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--shard-mb", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    load_at_start = load_average()
    try:
        import streaming  # noqa: F401

        have_streaming = True
    except ImportError:
        have_streaming = False
    root = scratch("formats-")
    pairs: dict[str, tuple] = {}
    if have_streaming:
        for name, compression in (("mds", None), ("mds-zstd", "zstd")):
            folder = os.path.join(root, name)
            write_mds(folder, args.samples, args.block, args.shard_mb, compression)
            pairs[name] = (lambda f=folder: ours(f, "mds"), lambda f=folder: streaming_peer(f))
    folder = os.path.join(root, "wds")
    write_wds(folder, args.samples, args.block, args.shard_mb)
    pairs["webdataset"] = (lambda: ours(folder, "webdataset"), lambda: webdataset_peer(folder))
    for mine, _ in pairs.values():
        mine()  # writes the product's shard index, warms the page cache for both sides
    progress("shards written and indexed")
    rates: dict[str, list[float]] = {f"{k}/{side}": [] for k in pairs for side in ("ours", "peer")}
    variants = [(k, side) for k in pairs for side in (0, 1)]
    for rep in range(args.reps):
        for k, side in rotated(variants, rep):
            seconds, n = pairs[k][side]()
            assert n == args.samples, (k, side, n)
            rates[f"{k}/{'ours' if side == 0 else 'peer'}"].append(n / seconds)
        progress(f"rep {rep + 1}/{args.reps}")
    peer_names = {"mds": "StreamingDataset", "mds-zstd": "StreamingDataset", "webdataset": "webdataset.WebDataset"}
    lines = [
        f"{args.samples} samples of (int, {args.block + 1} uint16 tokens, str), {args.shard_mb} MB shards on local "
        f"disk, read whole; {args.reps} reps, alternating; samples/s median (min-max).",
        "",
        "| format | ShardedDataset, samples/s | peer's reader, samples/s | peer | ours / peer | goal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in pairs:
        a, b = rates[f"{k}/ours"], rates[f"{k}/peer"]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        lines.append(
            f"| {k} | {spread(a, '{:,.0f}')} | {spread(b, '{:,.0f}')} | "
            f"{peer_names[k]} | {ratio:.2f}x | {'met' if ratio >= GOAL else 'missed'} (>= {GOAL}x) |"
        )
    if not have_streaming:
        lines.append("\nMDS rows left out: mosaicml-streaming is not installed in this Python.")
    record("Other tools' shard formats: MDS and WebDataset read vs their own readers (issue 48)", lines, load_at_start)
