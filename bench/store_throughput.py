"""Store throughput: CheckpointStore save/load vs writing/reading the same bytes with plain fsspec.

The store adds hashing, a manifest, a pointer and verification; this measures what that costs.
"""

from __future__ import annotations

import time
import uuid

import fsspec
import torch

from bench.common import command_line, local_s3, median, record
from checkpointing import CheckpointStore, Writer
from checkpointing.store import serialize


def _pair(folder: str, options: dict | None, state: dict, reps: int) -> dict[str, list[float]]:
    blob = serialize({"state.pt": state})["state.pt"]
    fs, root = fsspec.core.url_to_fs(folder, **(options or {}))
    out = {"store save": [], "raw put": [], "store load": [], "raw get": []}
    for i in range(reps):  # alternate store and raw in each repetition
        store = CheckpointStore(folder, f"s{uuid.uuid4().hex[:8]}", storage_options=options)
        t0 = time.perf_counter()
        store.save("c", {"state.pt": state}, progress={"samples_seen": i}, writer=Writer.current(1))
        out["store save"].append(time.perf_counter() - t0)
        raw = f"{root}/raw-{uuid.uuid4().hex[:8]}.pt"
        t0 = time.perf_counter()
        buf = serialize({"x": state})["x"]  # the raw side serializes too, to compare like with like
        fs.pipe_file(raw, buf)
        out["raw put"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.load_latest(["state.pt"])
        out["store load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(__import__("io").BytesIO(fs.cat_file(raw)), weights_only=True)
        out["raw get"].append(time.perf_counter() - t0)
    out["bytes"] = [len(blob)]
    return out


def run(size_mb: int = 200, reps: int = 3, s3: bool = True) -> None:
    state = {"state": {"model": {"w": torch.randn(size_mb * 2**20 // 4)}}}
    lines = ["| store | MB | save s (store / raw) | save ratio raw/store | load s (store / raw) | load ratio raw/store |",
             "| --- | --- | --- | --- | --- | --- |"]
    import tempfile

    targets = [("local folder", tempfile.mkdtemp(prefix="bench-store-"), None)]
    ctx = local_s3() if s3 else None
    if ctx:
        url, options = ctx.__enter__()
        targets.append(("S3 over HTTP (moto)", url, options))
    try:
        for label, folder, options in targets:
            r = _pair(folder, options, state, reps)
            ss, rs, sl, rl = (median(r[k]) for k in ("store save", "raw put", "store load", "raw get"))
            lines.append(f"| {label} | {r['bytes'][0] / 1e6:.0f} | {ss:.2f} / {rs:.2f} | {rs / ss:.2f} | "
                         f"{sl:.2f} / {rl:.2f} | {rl / sl:.2f} |")
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    record("Store throughput (goal: ratio >= 0.9)", command_line(), lines + [
        "", "Both sides serialize with torch.save and deserialize with torch.load(weights_only=True); the store "
            "adds sha256 (hashed while reading), a manifest, the fence check and the latest pointer."])
