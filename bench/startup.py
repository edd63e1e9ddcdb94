"""Fixed costs of the whole command: ``python -m flows.train`` end to end against the same job as a bare PyTorch
script and as PyTorch Lightning with a checkpoint per epoch, each a whole process (issue 25, items 1-3).

Variants, alternating (each repetition starts one later), medians:

* ``flow, running server``: ``python -m flows.train ...`` with ``PREFECT_API_URL`` naming a server this benchmark
  started once (``make server``'s situation);
* ``flow, temporary server``: the same command with no server: it starts its own (flows/server.py) while it imports.
  Its database exists (made by a warm-up run), as on any machine after its first run;
* ``bare script``: ``python -m bench.jobs bare``: the same steps in a plain loop (bench/plain.py: the product's
  seeding and sample order, so the epoch losses must equal the units' losses: checked), then the same final
  evaluation, no checkpoints;
* ``Lightning``: ``python -m bench.jobs lightning``: the same model, data, epochs and final evaluation, with
  ``ModelCheckpoint(save_last=True, every_n_epochs=1)``.

The flow's wall time comes from the real command; where it goes comes from one more run of each flow variant
through ``bench.startup_probe`` (the same command with a few product functions wrapped to record when they run),
the bare and Lightning scripts' from their own marks. Interpreter start is in every wall time.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from bench import whole
from bench.common import isolate_prefect, load_average, parser, progress, record, rotated, scratch
from bench.startup_report import render

FLOWS = ("flow, running server", "flow, temporary server")
VARIANTS = (*FLOWS, "bare script", "Lightning")


@dataclass
class Job:
    recipe_args: dict
    batch: int
    epochs: int
    seed: int = 1

    def flags(self, folder: str, run_name: str) -> list[str]:
        return ["--recipe", "synthetic", "--recipe_args", json.dumps(self.recipe_args), "--run_name", run_name,
                "--save_folder", folder, "--global_batch_size", str(self.batch), "--max_duration",
                f"{self.epochs}ep", "--save_interval", "1ep", "--seed", str(self.seed)]  # fmt: skip


@dataclass
class Figures:
    """What one run of this benchmark measured (seconds); ``render`` turns it into tables."""

    job: Job
    threads: int
    walls: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # the process and the children it waited for
    in_loop: dict[str, list[float]] = field(default_factory=dict)  # training steps only (Lightning: fit)
    before_flow: dict[str, list[float]] = field(default_factory=dict)  # start -> the flow's first log line
    after_flow: dict[str, list[float]] = field(default_factory=dict)  # the flow's last log line -> exit
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # variant -> part -> seconds (one run)
    losses: dict[str, list[float]] = field(default_factory=dict)  # per epoch/unit, first repetition


def flow_run(job: Job, env: dict[str, str], name: str, figures: Figures, variant: str) -> None:
    done = whole.run(whole.python("-m", "flows.train", *job.flags(scratch("startup-"), name)), env)
    units = done.units_done()
    figures.walls.setdefault(variant, []).append(done.wall)
    figures.cpu.setdefault(variant, []).append(done.cpu)
    figures.in_loop.setdefault(variant, []).append(sum(job_samples(job) / rate for _, _, rate, _ in units))
    figures.before_flow.setdefault(variant, []).append(done.first(r"Beginning flow run"))
    figures.after_flow.setdefault(variant, []).append(done.wall - done.first(r"Flow run '[^']*' - Finished in state"))
    figures.losses.setdefault(variant, [loss for _, loss, _, _ in units])


def script_run(job: Job, kind: str, env: dict[str, str], figures: Figures, variant: str) -> None:
    done = whole.run(whole.python("-m", "bench.jobs", kind, json.dumps(asdict(job))), env)
    result = json.loads(done.output.strip().splitlines()[-1])
    marks = result["marks"]
    figures.walls.setdefault(variant, []).append(done.wall)
    figures.cpu.setdefault(variant, []).append(done.cpu)
    figures.in_loop.setdefault(variant, []).append(marks["in-loop seconds"])
    figures.losses.setdefault(variant, result["losses"])
    figures.parts.setdefault(variant, script_parts(marks, done.wall))


def script_parts(marks: dict[str, float], wall: float) -> dict[str, float]:
    return {
        "start-up: interpreter, imports": marks["imports done"],
        "model, optimizer, data": marks["model built"] - marks["imports done"],
        "in-loop training": marks["in-loop seconds"],
        "between epochs (loader, bookkeeping)": marks["training done"]
        - marks["model built"]
        - marks["in-loop seconds"],
        "final evaluation": marks["evaluation done"] - marks["training done"],
        "teardown (exit)": wall - marks["evaluation done"],
    }


def probe_parts(job: Job, env: dict[str, str], name: str) -> dict[str, float]:
    """Where the time of one whole command goes (bench/startup_probe.py), as consecutive parts of its wall time."""
    out = os.path.join(scratch("probe-"), "marks.json")
    done = whole.run(whole.python("-m", "bench.startup_probe", out, "--", *job.flags(scratch("startup-"), name)), env)
    with open(out) as f:
        probe = json.load(f)
    m = {k: [t - done.start for t in v] for k, v in probe["marks"].items()}
    units, ins, outs = probe["units"], m["unit in"], m["unit out"]
    train = sum(u["train_seconds"] for u in units)
    checkpoints = sum(u["checkpoint_seconds"] for u in units)
    waited = m["server wait out"][0] - m["server wait in"][0] if "server wait in" in m else 0.0
    evaluated = m["evaluation out"][0] if "evaluation out" in m else outs[-1]
    ended = min(m.get("server stop in", [m["flow returned in"][0]])[0], m["flow returned in"][0])
    return {
        "start-up: interpreter, imports": m["imports done"][0],
        "pre-flight (flags, recipe, model on meta)": m["pre-flight out"][0] - m["imports done"][0],
        "waiting for the temporary server": waited,
        "flow start (Prefect creates the flow run)": m["flow body in"][0] - m["pre-flight out"][0] - waited,
        "run set-up (claim, latest, first task)": ins[0] - m["flow body in"][0],
        "in-loop training": train,
        "checkpoints": checkpoints,
        "units: build, restore, bookkeeping": sum(o - i for i, o in zip(ins, outs, strict=True)) - train - checkpoints,
        "between units (Prefect task runs)": sum(i - o for o, i in zip(outs, ins[1:], strict=False)),
        "final evaluation": evaluated - outs[-1],
        "flow end (artifacts, final state)": ended - evaluated,
        "teardown (logs shipped, server stopped, exit)": done.wall - ended,
    }


def job_samples(job: Job) -> int:
    return job.recipe_args["num_samples"] // job.batch * job.batch


def measure(job: Job, reps: int, threads: int) -> Figures:
    figures = Figures(job, threads)
    temporary_home = scratch("prefect-home-temporary-")  # the temporary server's database, apart from the held one
    tiny = Job({**job.recipe_args, "num_samples": job.batch * 2}, job.batch, 1, job.seed)
    with whole.held_server() as url:
        envs = {
            FLOWS[0]: whole.child_env(threads, PREFECT_API_URL=url),
            FLOWS[1]: whole.child_env(threads, PREFECT_HOME=temporary_home),
            "bare script": whole.child_env(threads),
            "Lightning": whole.child_env(threads),
        }
        warm = Figures(tiny, threads)  # warm-up: page cache, the temporary server's database, Lightning's imports
        for variant in VARIANTS:
            run_variant(variant, tiny, envs[variant], "warm", warm)
        progress("warm-up done")
        for rep in range(reps):
            for variant in rotated(list(VARIANTS), rep):
                run_variant(variant, job, envs[variant], f"rep{rep}", figures)
                progress(f"rep {rep + 1}/{reps}: {variant} {figures.walls[variant][-1]:.2f} s")
        for variant in FLOWS:
            figures.parts[variant] = probe_parts(job, envs[variant], "probe")
            progress(f"breakdown of {variant}: {sum(figures.parts[variant].values()):.2f} s")
    return figures


def run_variant(variant: str, job: Job, env: dict[str, str], name: str, figures: Figures) -> None:
    if variant in FLOWS:
        flow_run(job, env, name, figures, variant)
    else:
        script_run(job, "bare" if variant == "bare script" else "lightning", env, figures, variant)


def main(argv: list[str]) -> None:
    p = parser("startup", "The whole command vs a bare PyTorch script vs Lightning, same job, whole processes.")
    p.add_argument("--samples", type=int, default=32768, help="samples per epoch of the synthetic recipe")
    p.add_argument("--hidden", type=int, default=512, help="width of the synthetic MLP")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthetic MLP")
    p.add_argument("--in-features", type=int, default=64, help="input features of the synthetic data")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--epochs", type=int, default=4, help="epochs (one unit and one checkpoint each)")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions, medians reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every variant (OMP_NUM_THREADS)")
    a = p.parse_args(argv)
    load = load_average()
    isolate_prefect()
    whole.compile_bytecode()
    args = {"num_samples": a.samples, "hidden": a.hidden, "num_layers": a.layers, "in_features": a.in_features,
            "eval_samples": 1024}  # fmt: skip
    figures = measure(Job(args, a.batch, a.epochs), a.reps, a.threads)
    record("Fixed costs: the whole command vs a bare script vs Lightning (issue 25)", render(figures), load)
