"""Resume latency: relaunch of `python -m flows.train` -> first resumed step, split into its parts.

Every relaunch is a fresh process that resumes a run from its ~200 MB checkpoint and trains one more step.
It is timed from outside three ways, none of which edits the product:

* ``bench.resume_probe`` runs the real ``flows.train.main`` after wrapping a few product functions so that
  each records when it was entered and left (the fine split below);
* the timestamps of the product's own log lines in the same process's output (a coarse cross-check);
* ``python -X importtime -c "import flows.train"`` for what the imports are made of.

Prefect start is measured both ways a relaunch meets it: no API configured (``python -m flows.train``
starts an ephemeral server) and ``PREFECT_API_URL`` pointing at a running server (API connect).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
import uuid

from bench.common import load_average, local_s3, parser, record, rotated, scratch, spread

RECIPE = "recipes.synthetic:SyntheticRecipe"
_TS = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \|")
PARTS = [
    "interpreter start",
    "imports",
    "config + recipe check",
    "Prefect start",
    "flow planning (latest, claim, progress artifact)",
    "task start",
    "build model + optimizer",
    "checkpoint resolve",
    "download + sha256",
    "unpickle (weights_only)",
    "state restore (load_state_dict, RNG)",
    "data seek + first batch",
    "first step",
]


class Run:
    """A run with a committed checkpoint, relaunched one step further each time."""

    def __init__(self, folder: str, options: dict, args: dict, steps: int) -> None:
        self.name, self.folder, self.options = f"r{uuid.uuid4().hex[:8]}", folder, options
        self.args, self.steps = args, steps

    def flags(self) -> list[str]:
        self.steps += 1
        flags = [
            "--run_name",
            self.name,
            "--save_folder",
            self.folder,
            "--recipe",
            RECIPE,
            "--recipe_args",
            json.dumps(self.args),
            "--max_duration",
            f"{self.steps}ba",
            "--save_interval",
            "1000ba",
            "--global_batch_size",
            "32",
            "--seed",
            "1",
            "--log_every_n_steps",
            "1",
            "--unit_retries",
            "0",
        ]
        return flags + (["--storage_options", json.dumps(self.options)] if self.options else [])


KILLED = "running server, local folder, after a SIGKILL"
# What a SIGKILLed trainer leaves for its relaunch to meet: its claim and a lease renewed moments ago
_HOLDER = """
import sys, time
from checkpointing import CheckpointStore
from checkpointing.fencing import Lease
store = CheckpointStore(sys.argv[1], sys.argv[2])
Lease(store.fence, store.claim_generation(label="killed"), on_stop=lambda request: None).start()
print("holding", flush=True)
time.sleep(600)
"""


def sigkill_a_holder(run: Run, env: dict) -> None:
    """Claims the run in another process, which holds its lease as a trainer does, and SIGKILLs it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, run.folder, run.name], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"holding":
        proc.kill()
        raise RuntimeError("the lease holder did not start")
    proc.kill()
    proc.wait(timeout=60)


def _train_first(run: Run) -> None:
    """The checkpoint to resume from, trained in this process (against the running test server)."""
    from flows.train import TrainConfig, train

    train(
        TrainConfig(
            run_name=run.name,
            save_folder=run.folder,
            storage_options=run.options,
            recipe=RECIPE,
            recipe_args=run.args,
            max_duration=f"{run.steps}ba",
            save_interval="1000ba",
            global_batch_size=32,
            seed=1,
        )
    )


def relaunch(run: Run, env: dict) -> dict[str, float]:
    marks_file = os.path.join(scratch("marks-"), "marks.json")
    cmd = [sys.executable, "-m", "bench.resume_probe", marks_file, "--", *run.flags()]
    t_launch = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"relaunch failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    with open(marks_file) as f:
        m = json.load(f)
    os.unlink(marks_file)
    first = lambda k: m[k][0]  # noqa: E731
    total = lambda k: sum(o - i for i, o in zip(m[f"{k} in"], m[f"{k} out"], strict=False))  # noqa: E731
    parts = [
        first("probe start") - t_launch,
        first("imports done") - first("probe start"),
        first("load recipe out") - first("imports done"),
        first("flow body in") - first("load recipe out"),
        first("unit task in") - first("flow body in"),
        first("run unit in") - first("unit task in"),
        first("load into in") - first("run unit in"),
        first("load in") - first("load into in"),
        total("read+verify"),
        total("unpickle"),
    ]
    parts.append(first("restore out") - first("load in") - parts[-2] - parts[-1])  # apply state and the rest
    parts += [first("step in") - first("restore out"), first("step out") - first("step in")]
    out = dict(zip(PARTS, parts, strict=False))
    out["total"] = first("step out") - t_launch
    out.update(_from_log(proc.stdout, t_launch))
    return out


def _from_log(output: str, t_launch: float) -> dict[str, float]:
    """The coarse split read only from the timestamps of the product's log lines."""
    marks: dict[str, float] = {}
    day = datetime.datetime.fromtimestamp(t_launch).date()
    for line in output.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        t = datetime.datetime.combine(day, datetime.datetime.strptime(m.group(1), "%H:%M:%S.%f").time()).timestamp()
        if "Beginning flow run" in line:
            marks.setdefault("flow", t)
        elif re.search(r"unit \d+ \(attempt 1\): starting from checkpoint", line):
            marks.setdefault("resumed", t)
        elif re.search(r"unit \d+: step \d+,", line) and "resumed" in marks:
            marks.setdefault("step", t)
    if len(marks) < 3:
        if os.environ.get("BENCH_DEBUG"):
            print(output, file=sys.stderr)
        return {}
    return {
        "log: launch -> flow run begins": marks["flow"] - t_launch,
        "log: flow run begins -> unit resumed": marks["resumed"] - marks["flow"],
        "log: unit resumed -> first step logged": marks["step"] - marks["resumed"],
        "log: total": marks["step"] - t_launch,
    }


def import_breakdown(top: int = 7) -> tuple[float, list[tuple[str, float]]]:
    """``python -X importtime``: total of ``import flows.train`` and its largest top-level packages."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import flows.train"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((m.group(4), int(m.group(2)) / 1e6, len(m.group(3))))
    total = next(c for name, c, _ in rows if name == "flows.train")
    ours = {"flows", "tasks", "training", "checkpointing", "recipes"}
    packages = sorted([(n, c) for n, c, _ in rows if "." not in n and n not in ours], key=lambda r: -r[1])
    return total, packages[:top]


def main(argv: list[str]) -> None:
    p = parser("resume", "Relaunch -> first resumed step of python -m flows.train, split into its parts.")
    p.add_argument("--hidden", type=int, default=3584, help="width of the synthetic MLP (sets the checkpoint size)")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthetic MLP")
    p.add_argument("--reps", type=int, default=3, help="relaunches per mode (alternating), medians reported")
    p.add_argument("--no-s3", action="store_true", help="skip the mode that resumes from S3 (moto)")
    a = p.parse_args(argv)
    load = load_average()
    from bench.common import isolate_prefect

    home = isolate_prefect()
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    args = {"num_samples": 1 << 16, "hidden": a.hidden, "num_layers": a.layers, "eval_samples": 32}
    times: dict[str, list[dict]] = {}
    with prefect_test_harness(server_startup_timeout=180), local_s3() as s3:
        # The product's defaults (INFO lines on the console: they are read below); AWS_* were set by local_s3.
        base_env = {**os.environ, "PREFECT_HOME": home, "PREFECT_LOGGING_LEVEL": "INFO", "PYTHONPATH": os.getcwd()}
        for key in ("PREFECT_API_URL", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"):
            base_env.pop(key, None)
        server_env = {**base_env, "PREFECT_API_URL": PREFECT_API_URL.value()}
        local = Run(scratch("resume-"), {}, args, steps=2)
        modes = {
            "ephemeral server, local folder": (local, base_env),
            "running server, local folder": (local, server_env),
        }
        killed = Run(scratch("resume-killed-"), {}, args, steps=2)
        modes[KILLED] = (killed, server_env)
        if not a.no_s3:
            modes["running server, S3 (moto)"] = (Run(s3.fresh_bucket("bench-resume"), s3.options, args, 2), server_env)
        for run in {id(r): r for r, _ in modes.values()}.values():
            _train_first(run)
        first_ephemeral = relaunch(local, base_env)  # creates the ephemeral server's database in PREFECT_HOME
        for rep in range(a.reps):
            for mode in rotated(list(modes), rep):
                run, env = modes[mode]
                if mode == KILLED:
                    sigkill_a_holder(run, env)
                times.setdefault(mode, []).append(relaunch(run, env))
    imports_total, packages = import_breakdown()
    _report(a, times, first_ephemeral, imports_total, packages, load)


def _report(a, times, first_ephemeral, imports_total, packages, load) -> None:
    from bench.plain import parameter_bytes

    mb = 2 * parameter_bytes({"hidden": a.hidden, "num_layers": a.layers}) / 1e6
    modes = list(times)
    lines = [
        f"A run of the synthetic MLP hidden {a.hidden} x {a.layers} (checkpoint ~{mb:.0f} MB: weights + SGD "
        f"momentum) relaunched with `python -m flows.train` to train one more step; {a.reps} relaunches per "
        "mode, alternating, medians (min-max). Split by `bench.resume_probe` (wraps product functions from "
        "outside; nothing in the product edited).",
        "",
        "| part, seconds | " + " | ".join(modes) + " |",
        "| --- |" + " --- |" * len(modes),
    ]
    for part in [*PARTS, "total"]:
        cells = [spread([t[part] for t in times[m]]) for m in modes]
        lines.append(
            f"| {'**total: launch -> first resumed step done**' if part == 'total' else part} | "
            + " | ".join(cells)
            + " |"
        )
    log_keys = [k for k in times[modes[0]][0] if k.startswith("log: ")]
    if log_keys:
        lines += [
            "",
            "The same relaunches, split only by the timestamps of the product's log lines (a cross-check):",
            "",
            "| part, seconds | " + " | ".join(modes) + " |",
            "| --- |" + " --- |" * len(modes),
        ]
        for k in log_keys:
            lines.append(
                f"| {k[5:]} | " + " | ".join(spread([t.get(k, float("nan")) for t in times[m]]) for m in modes) + " |"
            )
    lines += [
        "",
        f"First relaunch on a fresh PREFECT_HOME (the ephemeral server creates its database): "
        f"Prefect start {first_ephemeral['Prefect start']:.1f} s, total {first_ephemeral['total']:.1f} s.",
        "",
        f'`python -X importtime -c "import flows.train"`: {imports_total:.2f} s in all (importtime itself '
        "slows imports); the largest third-party packages, each as first imported (a package that another "
        "one imports is inside that one's figure too): " + ", ".join(f"{n} {c:.2f} s" for n, c in packages) + ".",
    ]
    record("Resume latency: relaunch -> first resumed step", lines, load)
