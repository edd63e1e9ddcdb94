"""Resume latency: relaunch of `python -m flows.train` -> first resumed step, split into its parts.

From outside, by the timestamps of the product's own log lines: process start -> Prefect flow begins
(imports + Prefect start) -> unit resumed (checkpoint resolve, download, verify, state restore) ->
first step logged (data seek + one step). Inside, the same resume is timed part by part.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench.common import command_line, isolate_prefect, median, record

ARGS = {"num_samples": 1 << 16, "hidden": 4096, "num_layers": 3}
_TS = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \|")


def _stamp(line: str) -> float | None:
    m = _TS.match(line)
    if not m:
        return None
    today = datetime.date.today()
    t = datetime.datetime.combine(today, datetime.datetime.strptime(m.group(1), "%H:%M:%S.%f").time())
    return t.timestamp()


def _relaunch(folder: str, steps: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "flows.train", "--run_name", "lat", "--save_folder", folder, "--recipe",
           "recipes.synthetic:SyntheticRecipe", "--recipe_args", json.dumps(ARGS), "--max_duration", f"{steps}ba",
           "--save_interval", "1000ba", "--log_every_n_steps", "1"]
    env = dict(os.environ, PREFECT_LOGGING_LEVEL="INFO")
    t0 = time.time()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         timeout=600).stdout  # Prefect logs to stderr
    marks = {}
    for line in out.splitlines():
        ts = _stamp(line)
        if ts is None:
            continue
        if "Beginning flow run" in line and "flow" not in marks:
            marks["flow"] = ts
        elif "(attempt 1): starting from checkpoint" in line and "resumed" not in marks:
            marks["resumed"] = ts
        elif re.search(r"unit \d+: step \d+,", line) and "step" not in marks and "resumed" in marks:
            marks["step"] = ts
    return {"imports + Prefect start": marks["flow"] - t0, "resolve + download + verify + restore": marks["resumed"] - marks["flow"],
            "data seek + first step": marks["step"] - marks["resumed"], "total": marks["step"] - t0}


def _inside(folder: str) -> dict[str, float]:
    """The same resume, timed part by part in this process."""
    from recipes.synthetic import SyntheticRecipe
    from checkpointing import CheckpointStore
    from training.sampler import ResumableBatchSampler

    store = CheckpointStore(folder, "lat")
    t0 = time.perf_counter()
    info = store.latest()
    t1 = time.perf_counter()
    loaded = store.load(info, ["state.pt", "rng-rank0.pt"])
    t2 = time.perf_counter()
    recipe = SyntheticRecipe(**ARGS)
    model = recipe.build_model()
    opt = recipe.build_optimizer(model)
    t3 = time.perf_counter()
    model.load_state_dict(loaded.objects["state.pt"]["state"]["model"])
    opt.load_state_dict(loaded.objects["state.pt"]["state"]["optimizer"])
    t4 = time.perf_counter()
    p = info.progress
    next(iter(ResumableBatchSampler(ARGS["num_samples"], 32, seed=42, epoch=p["epoch"], start=p["sample_in_epoch"])))
    t5 = time.perf_counter()
    return {"resolve latest (pointer + manifest + listing)": t1 - t0, "download + sha256 + safe unpickle": t2 - t1,
            "build model + optimizer": t3 - t2, "load_state_dict": t4 - t3, "data seek": t5 - t4,
            "checkpoint MB": info.size_bytes / 1e6}


def run(reps: int = 3) -> None:
    isolate_prefect()
    folder = tempfile.mkdtemp(prefix="bench-resume-")
    subprocess.run([sys.executable, "-m", "flows.train", "--run_name", "lat", "--save_folder", folder, "--recipe",
                    "recipes.synthetic:SyntheticRecipe", "--recipe_args", json.dumps(ARGS), "--max_duration", "5ba",
                    "--save_interval", "5ba"], check=True, capture_output=True, timeout=600)
    outside = [_relaunch(folder, 6 + i) for i in range(reps)]  # each relaunch resumes and adds one step
    inside = [_inside(folder) for _ in range(reps)]
    lines = [f"Checkpoint: {inside[0]['checkpoint MB']:.0f} MB on a local folder; {reps} relaunches, medians. "
             "Each relaunch starts Prefect's ephemeral server (the usual case for `python -m flows.train`).", "",
             "| part (from the log of a relaunched process) | seconds |", "| --- | --- |"]
    lines += [f"| {k} | {median([o[k] for o in outside]):.2f} |" for k in outside[0]]
    lines += ["", "| part (timed inside one process) | seconds |", "| --- | --- |"]
    lines += [f"| {k} | {median([o[k] for o in inside]):.3f} |" for k in inside[0] if k != "checkpoint MB"]
    record("Resume latency", command_line(), lines)
