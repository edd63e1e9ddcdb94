"""Store throughput: CheckpointStore save/load vs writing/reading the same bytes with plain fsspec.

The store adds a sha256 of every file, a manifest, a fence check, the ``latest`` pointer and, on load,
resolving the newest good checkpoint and verifying what it reads. Three pairs, alternating, medians:

    save        store.save(objects)              vs torch.save to bytes + fs.pipe_file
    commit      store.commit(serialized blobs)   vs fs.pipe_file of the same blobs (bytes only)
    load        store.load_latest(files)         vs fs.cat_file + torch.load(weights_only=True)
    read        Storage.get_hashed (the store's read + sha256 of a file) vs fs.cat_file (bytes only)
"""

from __future__ import annotations

import io
import time
import uuid

import fsspec
import torch

from bench.common import OUT, LocalS3, load_average, local_s3, median, parser, record, rotated, scratch
from bench.plain import parameter_bytes
from checkpointing import CheckpointStore, Writer
from checkpointing.io.storage import Storage
from checkpointing.store import STATE_FILE, serialize
from recipes.synthetic import SyntheticRecipe
from training.unit import rng

FILES = [STATE_FILE, "rng-rank0.pt"]


def checkpoint_objects(hidden: int, layers: int) -> dict:
    """What a unit of the synthetic recipe saves: model, optimizer (SGD momentum), scheduler, progress, RNG."""
    recipe = SyntheticRecipe(num_samples=64, hidden=hidden, num_layers=layers)
    model = recipe.build_model()
    optimizer = recipe.build_optimizer(model)
    scheduler = recipe.build_scheduler(optimizer)
    batch = next(iter(torch.utils.data.DataLoader(recipe.train_dataset(), batch_size=32)))
    recipe.loss(model, batch).backward()
    optimizer.step()
    scheduler.step()  # one step: the momentum buffers exist, as in every checkpoint after the first step
    state = {
        "state": {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        },
        "progress": {"step": 1},
    }
    return {STATE_FILE: state, "rng-rank0.pt": rng.capture()}


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _pairs(
    folder: str,
    options: dict | None,
    objects: dict,
    blobs: dict[str, bytes],
    reps: int,
    first_rep: int = 0,
) -> dict[str, list]:
    fs, root = fsspec.core.url_to_fs(folder, **(options or {}))
    root = root.rstrip("/")
    out: dict[str, list[float]] = {}
    for rep in range(first_rep, first_rep + reps):
        store = CheckpointStore(folder, f"s{uuid.uuid4().hex[:8]}", storage_options=options)
        raw = f"{root}/raw-{uuid.uuid4().hex[:8]}"  # every write, store or raw, makes new files
        progress, writer = {"samples_seen": rep}, Writer.current(1)
        if store.storage.is_local:
            for sub in ("a", "b"):
                fs.makedirs(f"{raw}/{sub}", exist_ok=True)

        def raw_save():
            for f, obj in objects.items():
                buf = io.BytesIO()
                torch.save(obj, buf)
                fs.pipe_file(f"{raw}/a/{f}", buf.getvalue())

        def raw_load():
            for f in FILES:
                torch.load(io.BytesIO(fs.cat_file(f"{raw}/a/{f}")), map_location="cpu", weights_only=True)

        storage = Storage(store.uri, options)
        steps = {
            "save": [("store", lambda: store.save("a", objects, progress=progress, writer=writer)), ("raw", raw_save)],
            "commit": [
                ("store", lambda: store.commit("b", blobs, progress=progress, writer=writer)),
                ("raw", lambda: [fs.pipe_file(f"{raw}/b/{f}", b) for f, b in blobs.items()]),
            ],
            "load": [("store", lambda: store.load_latest(FILES)), ("raw", raw_load)],
            "read": [
                ("store", lambda: storage.get_hashed(f"checkpoints/b/{STATE_FILE}")),
                ("raw", lambda: fs.cat_file(f"{raw}/b/{STATE_FILE}")),
            ],
        }
        for what, pair in steps.items():
            for side, fn in rotated(pair, rep):
                wall, cpu = _timed(fn)
                out.setdefault(f"{what} {side}", []).append(wall)
                out.setdefault(f"{what} {side} cpu", []).append(cpu)
        if store.storage.is_local:  # keep the page cache and the disk as they were for the next repetition
            fs.rm(raw, recursive=True)
            fs.rm(store.storage.root, recursive=True)
    return out


def _profile(folder: str, objects: dict) -> str:
    from pyinstrument import Profiler

    OUT.mkdir(exist_ok=True)
    store = CheckpointStore(folder, f"p{uuid.uuid4().hex[:8]}")
    profiler = Profiler(interval=0.001)
    profiler.start()
    store.save("p", objects, progress={"samples_seen": 0}, writer=Writer.current(1))
    store.load_latest(FILES)
    profiler.stop()
    path = OUT / "store-local.txt"
    path.write_text(profiler.output_text(unicode=False, show_all=True))
    (OUT / "store-local.html").write_text(profiler.output_html())
    return str(path.relative_to(OUT.parent.parent))


def main(argv: list[str]) -> None:
    p = parser("store", "CheckpointStore save/load vs the same bytes with plain fsspec, local folder and S3 (moto).")
    p.add_argument("--hidden", type=int, default=3584, help="width of the synthetic MLP whose state is saved")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthetic MLP")
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions, median reported")
    p.add_argument("--no-s3", action="store_true", help="local folder only")
    p.add_argument("--profile", action="store_true", help="also profile one local save + load (bench/out/)")
    a = p.parse_args(argv)
    load = load_average()
    objects = checkpoint_objects(a.hidden, a.layers)
    blobs = serialize(objects)
    size = sum(len(b) for b in blobs.values())
    results = {"local folder": _pairs(scratch("store-"), None, objects, blobs, a.reps)}
    if not a.no_s3:
        with local_s3() as s3:
            results["S3 over HTTP (moto)"] = _s3_pairs(s3, objects, blobs, a.reps)
    profile = _profile(scratch("store-prof-"), objects) if a.profile else ""
    lines = [
        f"Checkpoint: the state of the synthetic MLP hidden {a.hidden} x {a.layers} "
        f"({parameter_bytes({'hidden': a.hidden, 'num_layers': a.layers}) / 1e6:.0f} MB of parameters) with "
        f"SGD momentum, scheduler and RNG: {size / 1e6:.0f} MB in {len(blobs)} files. {a.reps} alternating "
        "repetitions, medians. Ratio = raw time / store time = the store's throughput as a fraction of plain "
        "fsspec's (goal >= 0.9).",
        "",
        "| store | operation | store s | raw s | ratio | goal >= 0.9 | CPU-s of this process, store / raw |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in results.items():
        for what, desc in [
            ("save", "save (serialize + write)"),
            ("commit", "commit (write the bytes)"),
            ("load", "load (resolve + read + verify + unpickle)"),
            ("read", "read + sha256 (bytes)"),
        ]:
            st, rw = median(r[f"{what} store"]), median(r[f"{what} raw"])
            cpu = f"{median(r[f'{what} store cpu']):.2f} / {median(r[f'{what} raw cpu']):.2f}"
            lines.append(
                f"| {label} | {desc} | {st:.3f} | {rw:.3f} | {rw / st:.2f} | "
                f"{'met' if rw / st >= 0.9 else 'missed'} | {cpu} |"
            )
    lines += [
        "",
        "moto's S3 server runs in a child process on the same 2 cores; its own speed (~30-50 MB/s put) "
        "bounds both sides, so the S3 rows show what the protocol adds, not what a real bucket would do. "
        "The CPU column is this process's own CPU time (all threads; moto's is not in it): on S3 it is "
        "what an upload in the background takes from training.",
    ]
    if profile:
        lines.append(f"Profile of one local save + load: {profile}")
    record("Store throughput (goal: ratio >= 0.9)", lines, load)


def _s3_pairs(s3: LocalS3, objects: dict, blobs: dict[str, bytes], reps: int) -> dict[str, list]:
    out: dict[str, list] = {}
    for rep in range(reps):  # a fresh bucket per repetition keeps moto's memory bounded
        r = _pairs(s3.fresh_bucket(f"bench-store-{rep}"), s3.options, objects, blobs, 1, first_rep=rep)
        for k, v in r.items():
            out.setdefault(k, []).extend(v)
    return out
