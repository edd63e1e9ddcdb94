"""Snapshots inside a unit (``snapshot_interval``, checkpointing/commit/snapshots.py) and the host-memory tier (issue 33).

A. Stall per checkpoint. A real GPT session (``recipes.gpt``, one AdamW step taken so the optimizer's two buffers
   exist), ~200 MB and ~2 GB of state. Alternating, medians and p99 over ``--reps`` after ``--warmups`` (each of
   the first snapshots may find their slot still being made on the slot thread, asked for by ``prepare`` one gap
   before the first, as a unit's start does: those that waited for it are reported apart):
   ``copy``: every state tensor copied into reused tensors of the same shape (CUDA: pinned, ``non_blocking``, then
   synchronized), the floor; ``snapshot``: ``Checkpointer.snapshot(session, metrics)``, its returned stall and the
   wall time of the whole call (RNG capture, ``state_dict()``, the checkpoint's name: all on the training thread),
   then ``--gap`` seconds of sleep (the step that would run: the publish and the upload go on meanwhile). For
   reference, fewer reps, the old ways: ``serialize`` (``commit.request(background=True)``: what ``async_upload``
   stalled for) and ``commit`` (a synchronous streamed commit to the store).
B. Throughput: one unit of ``--steps`` steps of a small GPT (``run_unit``, its own ``SessionCache`` and save folder
   per run) with a snapshot every 1, 10, 100 steps and none; slowdown = train_seconds / train_seconds(none) - 1.
C. Work lost on SIGKILL: ``python -m tests.run_lifecycle`` killed (its whole process group) at a uniform random
   moment after step ``k``, relaunched with the same command; lost = last step it logged - the step the relaunch
   started at. Tier on, tier off (both ``--snapshot_interval 1ba``), and the old way (unit checkpoints only). Then
   the restore of the same ~200 MB state from the tier (``newest_snapshot``) and from the store (``load_latest``).
D. Peak host memory: the ~200 MB GPT run in a child process with and without ``--snapshot_interval 1ba``; the
   child's peak resident set (VmHWM) and its tier's files, polled while it runs; (state + difference) / state.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import load_average, median, parser, progress, record, rotated, scratch, spread

ROOT = Path(__file__).resolve().parents[1]
SIZES: dict[str, dict[str, Any]] = {  # GPT widths: params + AdamW's two buffers, fp32
    "200MB": {"n_layer": 5, "n_head": 8, "n_embd": 512},
    "1GB": {"n_layer": 14, "n_head": 12, "n_embd": 768},
    "2GB": {"n_layer": 24, "n_head": 12, "n_embd": 768},
}
SMALL_GPT = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 64, "dropout": 0.0}
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 256, "dropout": 0.0}  # char vocabulary
MODELS = {"small": SMALL_GPT, "gpt2": GPT2_SMALL}
STEP = re.compile(r"unit \d+: step (\d+),")
STARTED = re.compile(r"unit \d+ \(attempt \d+\): starting from (.+) at epoch \d+, step (\d+),")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank): p99 of 12 samples is their maximum."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def ms(xs: list[float]) -> str:
    return f"{median(xs) * 1e3:.1f} / {pct(xs, 0.99) * 1e3:.1f}"


# -- A. the stall ---------------------------------------------------------------------------------
def gpt_config(widths: dict, device: str, **extra: Any) -> Any:
    from training.config import TrainConfig

    args = {"block_size": 64, "dropout": 0.0, **widths}
    fields = {"max_duration": "1000ba", "save_interval": "1000ba", "global_batch_size": 4, "log_every_n_steps": 1000}
    fields.update(extra)
    fields.setdefault("save_folder", scratch("snap-"))
    return TrainConfig(recipe="gpt", recipe_args=args, device=device, run_name="s", **fields)


def trained_session(config: Any) -> tuple[Any, Any]:
    """A restored session after one real optimizer step (AdamW's buffers exist), and its store."""
    from torch.utils.data import default_collate

    from training.start.store import open_store
    from training.unit import session as sessions
    from training.unit.loop import _step

    store = open_store(config)
    s, _ = sessions.restore(config, store)
    ids = list(range(config.global_batch_size))
    collate = s.hooks.collate_fn or default_collate
    _step(s, [ids], len(ids), iter([collate([s.dataset[i] for i in ids])]))
    s.progress.advance(len(ids), len(s.dataset))
    return s, store


def state_tensors(s: Any) -> list[torch.Tensor]:
    from checkpointing.commit.snapshots import flatten

    return flatten(s.state.state_dict()).tensors


class Copy:
    """The floor: every state tensor copied into reused buffers of the same shape (pinned ones from a GPU)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.sources = tensors
        self.cuda = any(t.is_cuda for t in tensors)
        self.targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]

    def __call__(self) -> float:
        t0 = time.perf_counter()
        for src, dst in zip(self.sources, self.targets, strict=True):
            dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


@dataclass
class Stalls:
    label: str
    device: str
    nbytes: int
    times: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, seconds: float) -> None:
        self.times.setdefault(key, []).append(seconds)


WAITED = "snapshot waiting for its slot being made (stall returned)"
INLINE = "making one slot on the training thread (each of the first snapshots' stall before c1239c5)"


def making_inline(size: int, reps: int) -> list[float]:
    """What making one slot of ``size`` bytes costs the thread that makes it: the tier's file reserved and every page
    touched (what the slot thread does), here on this thread, in a tier of its own, removed after."""
    from checkpointing.host_tier.tier import HostTier

    seconds = []
    for rep in range(reps):
        tier = HostTier(f"file:///bench-inline-slot-{os.getpid()}-{rep}")
        try:
            t0 = time.perf_counter()
            slot = tier.allocate(0, size)
            torch.frombuffer(slot.buffer, dtype=torch.uint8).fill_(0)
            seconds.append(time.perf_counter() - t0)
            slot.buffer.close()
        finally:
            tier.remove()
    return seconds


def snapshot_once(checkpointer: Any, s: Any, figures: Stalls) -> None:
    """One ``Checkpointer.snapshot``: its stall, the whole call, and on CUDA the copy's end after the return."""
    s.progress.advance(4, len(s.dataset))
    waits = checkpointer.snapshots.stats.waits
    t0 = time.perf_counter()
    stall = checkpointer.snapshot(s, {"train_loss": 0.0})
    call = time.perf_counter() - t0
    if checkpointer.snapshots.stats.waits > waits:  # its slot was being made (on the snapshot-slots thread)
        figures.add(WAITED, stall)
        return
    if s.device.type == "cuda":
        event = checkpointer.snapshots._copy_event
        if event is not None:
            event.synchronize()
        figures.add("copy done after return", time.perf_counter() - t0 - call)
        checkpointer.snapshots._copy_event = None  # no optimizer step follows here to wait for it
    figures.add("snapshot (stall returned)", stall)
    figures.add("snapshot (whole call)", call)


def old_ways(checkpointer: Any, s: Any, store: Any, figures: Stalls, reps: int) -> None:
    """Serialization to bytes (what async_upload stalled for) and a synchronous streamed commit, ``reps`` each."""
    from checkpointing.commit import committer as commits
    from checkpointing.commit.committer import Committer, CommitTerms

    committer = Committer()
    for rep in range(reps):
        for way in rotated(["serialize", "commit"], rep):
            s.progress.advance(4, len(s.dataset))
            progress_ = s.progress.as_dict()
            objects = {"state.pt": {"state": s.state.state_dict(), "progress": progress_}}
            terms = CommitTerms(store, progress_, checkpointer.writer, {"metrics": {}})
            t0 = time.perf_counter()
            if way == "serialize":
                commits.request(terms, objects, background=True)
            else:
                info = committer.commit(commits.request(terms, objects, background=False)).wait()
            figures.add(way, time.perf_counter() - t0)
            if way == "commit":
                store.delete(info.name)
        progress(f"{figures.label}: old ways rep {rep + 1}/{reps}")


def measure_stall(size: str, device: str, reps: int, warmups: int, old_reps: int, gap: float) -> Stalls:
    from checkpointing.commit.committer import Committer
    from training.unit.checkpointer import Checkpointer

    config = gpt_config(SIZES[size], device, snapshot_interval="1ba")
    s, store = trained_session(config)
    tensors = state_tensors(s)
    figures = Stalls(size, device, sum(t.numel() * t.element_size() for t in tensors))
    progress(f"{size}: {figures.nbytes / 1e9:.3f} GB of state in {len(tensors)} tensors on {device}")
    copy, committer = Copy(tensors), Committer()
    checkpointer = Checkpointer(config, store, committer)
    first = Stalls(size, device, 0)
    checkpointer.prepare(s)  # a unit's start: the first slot is made while the first steps (``gap``) run
    time.sleep(gap)
    for rep in range(reps + warmups):
        scratchpad = first if rep < warmups else figures
        for way in rotated(["copy", "snapshot"], rep):
            if way == "copy":
                scratchpad.add("copy", copy())
            else:
                snapshot_once(checkpointer, s, scratchpad)
            time.sleep(gap)
        progress(
            f"{size}: rep {rep + 1}/{reps + warmups}: {', '.join(f'{k} {v[-1]:.3f}' for k, v in scratchpad.times.items())}"
        )
    if first.times.get(WAITED):
        figures.times.setdefault(WAITED, []).extend(first.times[WAITED])
    every = [t for f in (first, figures) for k in (WAITED, "snapshot (stall returned)") for t in f.times.get(k, [])]
    if every:  # the goal: the longest gap training sees, the run's first snapshots (slots being made) included
        figures.times["longest stall of all snapshots, the first included"] = [max(every)]
    if checkpointer.snapshots is not None:
        figures.times[INLINE] = making_inline(
            checkpointer.snapshots.usage.bytes // max(1, checkpointer.snapshots.usage.slots), 3
        )
        checkpointer.snapshots.remove_tier()
    committer.drop_snapshots()  # lets the last upload land, closes the pipeline (unpins its slots)
    old_ways(checkpointer, s, store, figures, old_reps)
    return figures


def render_stalls(all_stalls: list[Stalls]) -> list[str]:
    lines = [
        "| state | device | way | p50 / p99 ms | / copy (p50) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in all_stalls:
        base = median(f.times["copy"])
        for way, xs in f.times.items():
            lines.append(
                f"| {f.nbytes / 1e9:.2f} GB ({f.label}) | {f.device} | {way} (n={len(xs)}) | {ms(xs)} "
                f"| {median(xs) / base:.2f}x |"
            )
    return lines


# -- B. throughput --------------------------------------------------------------------------------
WARM_STEPS = 10


def one_unit(widths: dict, device: str, steps: int, every: str | None, batch: int) -> tuple[float, dict]:
    """A warm-up unit of ``WARM_STEPS`` steps with a snapshot every step (the pipeline's slots allocated, as in a run
    that has been going a while), then the measured unit from there to step ``steps`` in the same process."""
    from training.unit.loop import run_unit
    from training.unit.warm import SessionCache

    common = {"global_batch_size": batch, "log_every_n_steps": 10_000, "save_folder": scratch("unit-")}
    warm = gpt_config(widths, device, max_duration=f"{WARM_STEPS}ba", save_interval=f"{WARM_STEPS}ba", **common)
    config = gpt_config(widths, device, max_duration=f"{steps}ba", save_interval=f"{steps}ba", **common)
    cache = SessionCache()
    try:
        run_unit(warm.model_copy(update={"snapshot_interval": "1ba"}), cache=cache)
        result = run_unit(config.model_copy(update={"snapshot_interval": every}), cache=cache)
        assert result.steps == steps - WARM_STEPS, result.steps
    finally:  # the run's snapshot pipeline is closed (its slots unpinned and unmapped) before the next run's opens
        cache.committer.drop_snapshots()
        cache.forget()  # frees the model (GPU memory) before the next run builds its own
    return result.metrics["train_seconds"], result.metrics


def measure_throughput(widths: dict, device: str, steps: int, reps: int, batch: int) -> dict[str, list[float]]:
    variants: list[str | None] = [None, "1ba", "10ba", "100ba"]
    seconds: dict[str, list[float]] = {}
    one_unit(widths, device, WARM_STEPS + 5, "1ba", batch)  # warm-up: imports, first allocations
    for rep in range(reps):
        for every in rotated(variants, rep):
            t, metrics = one_unit(widths, device, steps, every, batch)
            seconds.setdefault(every or "none", []).append(t)
            stall = metrics.get("snapshot_seconds_max", 0.0)
            progress(
                f"throughput rep {rep + 1}/{reps}, every {every or '-'}: {t:.2f} s, max stall {stall * 1e3:.1f} ms"
            )
    return seconds


# Slowdown goals by (model, device): issue 33's for the small model; issue 45's for the 1 GB one on the CPU (a copy of
# 1 GB is a larger share of a CPU step) and for the GPU.
THROUGHPUT_GOALS = {
    ("small", "cpu"): {"1ba": 0.05, "10ba": 0.01},
    ("gpt2", "cpu"): {"1ba": 0.10, "10ba": 0.02},
    ("gpt2", "cuda"): {"1ba": 0.05, "10ba": 0.01},
}


def render_throughput(seconds: dict[str, list[float]], steps: int, label: str, goals: dict[str, float]) -> list[str]:
    none = seconds["none"]
    lines = [
        f"{label}: per run, a warm-up unit of {WARM_STEPS} steps with a snapshot every step (the pipeline's slots "
        f"allocated), then the measured unit (steps {WARM_STEPS + 1}-{steps}) in the same process; alternating, "
        "medians (min-max) of its train_seconds; slowdown = median over reps of (variant / none of the same rep) - 1.",
        "",
        "| snapshot every | train s | s/step | slowdown | goal |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in ["none", "1ba", "10ba", "100ba"]:
        xs = seconds[key]
        slow = median([x / n - 1 for x, n in zip(xs, none, strict=True)])
        goal = goals.get(key)
        verdict = "" if goal is None else f"<= {goal:.0%}: {'met' if slow <= goal else 'missed'}"
        per_step = median(xs) / (steps - WARM_STEPS) * 1e3
        lines.append(f"| {key} | {spread(xs)} | {per_step:.1f} ms | {slow:+.1%} | {verdict} |")
    return lines


# -- C. work lost on SIGKILL ----------------------------------------------------------------------
KILL_ARGS = {**SMALL_GPT}


def lifecycle_command(folder: str, extra: list[str], steps: int, unit: int) -> list[str]:
    import json

    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "k", "--save_folder", folder,
        "--recipe", "gpt", "--recipe_args", json.dumps(KILL_ARGS), "--device", "cpu",
        "--max_duration", f"{steps}ba", "--save_interval", f"{unit}ba", "--global_batch_size", "16",
        "--seed", "7", "--log_every_n_steps", "1", *extra,
    ]  # fmt: skip


def child_env(tier_dir: str, threads: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
    return {**env, "PYTHONPATH": str(ROOT), "TRAIN_HOST_TIER_DIR": tier_dir, "OMP_NUM_THREADS": str(threads)}


def launch(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(proc: subprocess.Popen, log: Path, found: Any, deadline_s: float = 300) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        hit = found(log.read_text())
        if hit:
            return hit
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"child ended or timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.005)


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


AGENT = re.compile(r"checkpoint agent: .* without closing its run(.*)")


def kill_once(
    extra: list[str], k: int, window: float, seed: int, steps: int, unit: int, elsewhere: bool = False, s3: Any = None
) -> tuple[int, int, float | None]:
    """(last step logged before the kill, the step the relaunch started at, seconds from the kill to the checkpoint
    agent's report or None): a fresh run, killed after step ``k`` plus a uniform random delay in [0, window), then
    relaunched until it says where it starts; ``elsewhere``: relaunched with a tier folder of its own, as on another
    machine (it resumes from the store); ``s3``: the store is that moto server (a bucket of its own), so the checkpoint
    agent runs, and the relaunch waits for its report (here the other machine is this one: a relaunch before the
    agent's lease would see the trainer's pid gone and claim at once)."""
    import json

    folder, tier_dir = scratch("kill-"), scratch("tier-")
    if s3 is not None:
        folder = f"{s3.fresh_bucket(f'kill-{seed}')}/runs"
        extra = [*extra, "--storage_options", json.dumps(s3.options)]
    env, logs = child_env(tier_dir), Path(scratch("logs-"))
    cmd = lifecycle_command(folder, extra, steps, unit)
    proc = launch(cmd, env, logs / "killed.log")
    wait_for(proc, logs / "killed.log", lambda text: any(int(x) >= k for x in STEP.findall(text)))
    time.sleep(random.Random(seed).uniform(0.0, window))
    kill(proc)
    killed_at = time.monotonic()
    last = max(int(x) for x in STEP.findall((logs / "killed.log").read_text()))
    agent_seconds = None
    if s3 is not None:
        deadline = killed_at + 300
        while not AGENT.search((logs / "killed.log").read_text()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no report of the checkpoint agent:\n{(logs / 'killed.log').read_text()[-3000:]}")
            time.sleep(0.01)
        agent_seconds = time.monotonic() - killed_at
    if elsewhere:
        env = child_env(scratch("tier-elsewhere-"))
    relaunched = launch(cmd, env, logs / "relaunched.log")
    started = wait_for(relaunched, logs / "relaunched.log", STARTED.search)
    kill(relaunched)
    return last, int(started.group(2)), agent_seconds


ELSEWHERE = "tier on, snapshot every step, relaunched on another machine (a tier folder of its own), local folder"
ELSEWHERE_S3 = "the same, S3 (moto) as the store: the checkpoint agent commits the newest snapshot after the kill"


def measure_kills(kills: int, k: int, window: float, steps: int, unit: int) -> tuple[dict[str, list], list[float]]:
    from bench.common import local_s3

    variants = {
        "tier on, snapshot every step": ["--snapshot_interval", "1ba"],
        ELSEWHERE: ["--snapshot_interval", "1ba"],
        ELSEWHERE_S3: ["--snapshot_interval", "1ba"],
        "tier off, snapshot every step": ["--snapshot_interval", "1ba", "--host_memory_tier", "false"],
        f"old way (unit checkpoints every {unit} steps)": [],
    }
    out: dict[str, list[tuple[int, int]]] = {name: [] for name in variants}
    agent_seconds: list[float] = []
    with local_s3() as s3:
        for i in range(kills):
            for name in rotated(list(variants), i):
                elsewhere = name in (ELSEWHERE, ELSEWHERE_S3)
                store = s3 if name == ELSEWHERE_S3 else None
                last, start, waited = kill_once(variants[name], k, window, 1000 + i, steps, unit, elsewhere, store)
                out[name].append((last, start))
                if waited is not None:
                    agent_seconds.append(waited)
                progress(f"kill {i + 1}/{kills}, {name}: last step {last}, relaunch started at {start}")
    return out, agent_seconds


def render_kills(out: dict[str, list[tuple[int, int]]], k: int, window: float) -> list[str]:
    lines = [
        f"Killed (SIGKILL to the process group) at a uniform random moment in [0, {window:.0f} s) after step {k} was "
        "logged; lost = last step logged - step the relaunch started at.",
        "",
        "| variant | kills | lost: max | median | distribution (steps lost: count) | goal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, pairs in out.items():
        lost = [last - start for last, start in pairs]
        dist = ", ".join(f"{n}: {lost.count(n)}" for n in sorted(set(lost)))
        goal = f"<= 1: {'met' if max(lost) <= 1 else 'missed'}" if name == "tier on, snapshot every step" else ""
        lines.append(f"| {name} | {len(lost)} | {max(lost)} | {median([float(x) for x in lost]):g} | {dist} | {goal} |")
    return lines


def measure_restore(reps: int) -> tuple[int, dict[str, list[float]]]:
    """Restore of the same ~200 MB state: from the tier (``newest_snapshot``) and from the store (``load_latest``)."""
    from checkpointing.commit.committer import Committer
    from checkpointing.host_tier.tier import HostTier
    from training.start.host_memory import newest_snapshot
    from training.unit.checkpointer import Checkpointer

    config = gpt_config(SIZES["200MB"], "cpu", snapshot_interval="1ba")
    s, store = trained_session(config)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(s))
    committer = Committer()
    checkpointer = Checkpointer(config, store, committer)
    saved = checkpointer.save(s, {"train_loss": 0.0}).pending.wait().name  # the store's checkpoint of this state
    s.progress.advance(4, len(s.dataset))  # the snapshot is one step further: the tier's is the one resumed from
    checkpointer.snapshot(s, {"train_loss": 0.0})
    committer.drop_snapshots()  # published and uploaded; the tier keeps it
    for info in store.list():  # as if killed before its upload landed: the store's newest is the unit's checkpoint
        if info.name != saved:
            store.delete(info.name)
    times: dict[str, list[float]] = {}
    for rep in range(reps):
        for way in rotated(["tier", "store"], rep):
            t0 = time.perf_counter()
            loaded = newest_snapshot(config, store) if way == "tier" else store.load_latest(["state.pt"])
            times.setdefault(way, []).append(time.perf_counter() - t0)
            assert loaded is not None, way
            del loaded
    HostTier(store.uri).remove()
    return nbytes, times


# -- D. peak host memory --------------------------------------------------------------------------
def tier_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a slot removed while walking
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def vm_hwm(pid: int) -> int:
    """The process's peak resident set so far (VmHWM, reset by exec), in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss(extra: list[str], steps: int, threads: int) -> tuple[int, int]:
    """(the child's peak RSS, the most bytes its tier folder held while it ran), both in bytes. The peak is VmHWM
    polled every 20 ms (``ru_maxrss`` from ``wait4`` would report this big parent's RSS, inherited at the fork)."""
    import json

    args = {**SIZES["200MB"], "block_size": 64, "dropout": 0.0}
    tier_dir = scratch("tier-")
    cmd = [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "m", "--save_folder", scratch("mem-"),
        "--recipe", "gpt", "--recipe_args", json.dumps(args), "--device", "cpu", "--max_duration", f"{steps}ba",
        "--save_interval", f"{steps}ba", "--global_batch_size", "4", "--log_every_n_steps", "1", *extra,
    ]  # fmt: skip
    proc = launch(cmd, child_env(tier_dir, threads), Path(tempfile.mkstemp(dir=scratch("logs-"))[1]))
    peak, most = 0, 0
    while proc.poll() is None:
        peak, most = max(peak, vm_hwm(proc.pid)), max(most, tier_bytes(tier_dir))
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"memory run failed ({proc.returncode}): {' '.join(cmd)}")
    return peak, most


def measure_memory(steps: int, reps: int, threads: int) -> dict[str, list[tuple[int, int]]]:
    variants = {"no snapshots": [], "snapshot every step": ["--snapshot_interval", "1ba"]}
    out: dict[str, list[tuple[int, int]]] = {name: [] for name in variants}
    for rep in range(reps):
        for name in rotated(list(variants), rep):
            out[name].append(peak_rss(variants[name], steps, threads))
            progress(f"memory rep {rep + 1}/{reps}, {name}: peak RSS {out[name][-1][0] / 1e6:.0f} MB")
    return out


def render_memory(out: dict[str, list[tuple[int, int]]], state: int, steps: int) -> list[str]:
    rss = {name: median([r for r, _ in pairs]) for name, pairs in out.items()}
    tier = max(t for _, t in out["snapshot every step"])
    diff = rss["snapshot every step"] - rss["no snapshots"]
    ratio = (state + diff) / state
    return [
        f"The 200MB GPT ({state / 1e6:.0f} MB of state), {steps} steps, one unit, in a child process; its peak "
        "resident set (VmHWM, polled; it includes the tier's shared pages the process touched), medians.",
        "",
        "| run | peak RSS MB | tier files, most held MB |",
        "| --- | --- | --- |",
        *[
            f"| {name} | {spread([r / 1e6 for r, _ in pairs], '{:.0f}')} | {max(t for _, t in pairs) / 1e6:.0f} |"
            for name, pairs in out.items()
        ],
        "",
        f"Difference {diff / 1e6:+.0f} MB; (state + difference) / state = {ratio:.2f} (goal <= 2.2: "
        f"{'met' if ratio <= 2.2 else 'missed'}); the tier's slots held at most {tier / 1e6:.0f} MB "
        f"= {tier / state:.2f}x the state.",
    ]


# -- main -----------------------------------------------------------------------------------------
def run_a(a: Any, load: str) -> None:
    torch.set_num_threads(a.threads)
    stalls = [measure_stall(size, a.device, a.reps, a.warmups, a.old_reps, a.gap) for size in a.sizes]
    lines = [
        f"GPT states (params + AdamW buffers, fp32), {a.reps} alternating reps after {a.warmups} warm-ups, {a.gap} s of sleep "
        f"after each (the step that would run); old ways {a.old_reps} reps; {torch.get_num_threads()} torch "
        "thread(s). 'stall returned' is what Checkpointer.snapshot returns (SnapshotPipeline.take); 'whole call' is "
        "the wall time of the call (RNG capture, state_dict(), the checkpoint's name, metadata as well).",
        "",
        *render_stalls(stalls),
    ]
    record(f"Issue 33: snapshot stall vs a copy ({a.device})", noted(a, lines), load)


def run_b(a: Any, load: str) -> None:
    torch.set_num_threads(a.threads)
    model = a.b_model or ("small" if a.device == "cpu" else "gpt2")
    widths = MODELS[model]
    seconds = measure_throughput(widths, a.device, a.steps, a.reps_b, a.batch)
    label = f"GPT {widths} on {a.device}, global batch {a.batch}, {torch.get_num_threads()} torch thread(s)"
    goals = THROUGHPUT_GOALS.get((model, a.device), {})
    record(
        f"Issue 33: throughput with snapshots ({a.device})",
        noted(a, render_throughput(seconds, a.steps, label, goals)),
        load,
    )


def run_c(a: Any, load: str) -> None:
    out, agent_seconds = measure_kills(a.kills, a.kill_after, a.window, a.kill_steps, a.kill_unit)
    nbytes, times = measure_restore(a.restore_reps)
    lines = [
        f"tests.run_lifecycle, GPT {KILL_ARGS}, global batch 16, 1 thread, {a.kill_steps} steps, units of "
        f"{a.kill_unit} steps; TRAIN_HOST_TIER_DIR a scratch folder on disk.",
        "",
        *render_kills(out, a.kill_after, a.window),
        "",
        f"S3: from the kill to the checkpoint agent's report (its start, imports, reading the tier, the commit), s: "
        f"{spread(agent_seconds, '{:.2f}')}.",
        "",
        f"Restore of the same {nbytes / 1e6:.0f} MB state ({a.restore_reps} alternating reps; the store is a local "
        "folder whose files are in the page cache):",
        "",
        "| from | s p50 (min-max) |",
        "| --- | --- |",
        f"| host-memory tier (`newest_snapshot`) | {spread(times['tier'], '{:.3f}')} |",
        f"| store (`load_latest(['state.pt'])`) | {spread(times['store'], '{:.3f}')} |",
    ]
    record("Issue 33: work lost on SIGKILL, restore from RAM vs store", noted(a, lines), load)


def run_d(a: Any, load: str) -> None:
    from recipes.gpt import GPTRecipe

    model = GPTRecipe(**SIZES["200MB"], block_size=64).build_model()
    state = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + AdamW's two buffers
    out = measure_memory(a.mem_steps, a.mem_reps, a.threads)
    record("Issue 33: peak host memory with snapshots", noted(a, render_memory(out, state, a.mem_steps)), load)


PARTS = {"A": run_a, "B": run_b, "C": run_c, "D": run_d}


def main(argv: list[str]) -> None:
    p = parser("snapshots", __doc__.splitlines()[0])
    p.add_argument("--parts", default="ABCD", help="which parts to run (letters)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (A, B, D's child)")
    p.add_argument("--sizes", nargs="+", default=["200MB", "2GB"], choices=list(SIZES), help="A: state sizes")
    p.add_argument("--reps", type=int, default=12, help="A: alternating repetitions after the warm-ups")
    p.add_argument("--warmups", type=int, default=3, help="A: warm-up repetitions (the first snapshots allocate slots)")
    p.add_argument("--old_reps", type=int, default=3, help="A: repetitions of the old ways")
    p.add_argument("--gap", type=float, default=0.3, help="A: seconds between snapshots (the step)")
    p.add_argument("--b_model", choices=list(MODELS), help="B: the model (default: small on cpu, gpt2 on cuda)")
    p.add_argument("--steps", type=int, default=150, help="B: steps per unit")
    p.add_argument("--batch", type=int, default=8, help="B: global batch size")
    p.add_argument("--reps_b", type=int, default=3, help="B: alternating repetitions")
    p.add_argument("--kills", type=int, default=20, help="C: kills per variant")
    p.add_argument("--kill_after", type=int, default=5, help="C: the kill comes after this step was logged")
    p.add_argument("--window", type=float, default=3.0, help="C: ... plus a uniform random delay up to this (s)")
    p.add_argument("--kill_steps", type=int, default=400, help="C: the run's length in steps")
    p.add_argument("--kill_unit", type=int, default=20, help="C: steps per unit (the old way's checkpoints)")
    p.add_argument("--restore_reps", type=int, default=5, help="C: restore repetitions")
    p.add_argument("--mem_steps", type=int, default=20, help="D: steps of the memory runs")
    p.add_argument("--mem_reps", type=int, default=2, help="D: alternating repetitions")
    p.add_argument("--note", default="", help="a sentence added to each record (what else ran, say)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("python -m bench snapshots --device cuda: CUDA is not available on this machine")
    for part in a.parts.upper():
        PARTS[part](a, load_average())


def noted(a: Any, lines: list[str]) -> list[str]:
    return [*lines, "", a.note] if a.note else lines
