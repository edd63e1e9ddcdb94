"""The tables of ``bench startup`` (bench/startup.py measures, this renders): ratios, goals, and where the time goes."""

from __future__ import annotations

import os

from bench.common import median, spread

FLOWS = ("flow, running server", "flow, temporary server")
FLOW_START = "flow start (Prefect creates the flow run)"

GOALS = [  # (variant, reference, at most)
    ("flow, running server", "bare script", 1.05),
    ("flow, temporary server", "bare script", 1.2),
    ("flow, running server", "Lightning", 1.0),
    ("flow, temporary server", "Lightning", 1.0),
]
# A part of the flow's time -> the part of a script's that does the same work. The pre-flight builds the model and
# optimizer on the meta device, paying torch._dynamo's import (~0.8 s here) that a bare script pays in its own build
# and Lightning inside its `fit`, which also holds its set-up and checkpoints.
ALIGNED = {
    "bare script": {
        "pre-flight (flags, recipe, model on meta)": "model, optimizer, data",
        "units: build, restore, bookkeeping": "model, optimizer, data",
        "between units (Prefect task runs)": "between epochs (loader, bookkeeping)",
        "teardown (logs shipped, server stopped, exit)": "teardown (exit)",
    },
    "Lightning": {
        "pre-flight (flags, recipe, model on meta)": "in-loop training",
        "units: build, restore, bookkeeping": "in-loop training",
        "checkpoints": "in-loop training",
        "between units (Prefect task runs)": "in-loop training",
        "teardown (logs shipped, server stopped, exit)": "teardown (exit)",
    },
}


def render(figures) -> list[str]:
    f, job = figures, figures.job
    walls = {v: median(w) for v, w in f.walls.items()}
    reps = len(next(iter(f.walls.values())))
    lines = [
        f"Job: synthetic MLP {job.recipe_args['in_features']} -> {job.recipe_args['hidden']} x "
        f"{job.recipe_args['num_layers']} layers, {job.recipe_args['num_samples']} samples, batch {job.batch}, "
        f"{job.epochs} epochs (a unit and a checkpoint each for the flow and Lightning), then an evaluation of "
        f"{job.recipe_args['eval_samples']} samples; {f.threads} torch thread(s) in every variant. Each variant a whole "
        f"process, {reps} alternating repetitions, medians (min-max).",
        "",
        "| variant | wall s | vs bare | vs Lightning | CPU s | before the flow s | after the flow s | in-loop s "
        "| in-loop vs bare |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, ws in f.walls.items():
        before = spread(f.before_flow[variant]) if variant in f.before_flow else "-"
        after = spread(f.after_flow[variant]) if variant in f.after_flow else "-"
        loop = median(f.in_loop[variant]) / median(f.in_loop["bare script"])
        lines.append(
            f"| {variant} | {spread(ws)} | {walls[variant] / walls['bare script']:.2f} "
            f"| {walls[variant] / walls['Lightning']:.2f} | {spread(f.cpu[variant])} | {before} | {after} "
            f"| {spread(f.in_loop[variant])} "
            f"| {loop:.2f} |"
        )
    same = [round(x, 4) for x in f.losses["bare script"]] == f.losses["flow, running server"]
    lines += [
        "",
        "CPU: the process's and its children's (the temporary server's included). Before / after the flow: from the "
        "process's start to the flow's first log line, and from its last to the process's exit. In-loop: the training steps alone (the flow's from its units' samples/s lines; Lightning's "
        "is its whole `fit`, checkpoints included). The flow's units and the bare loop trained the same thing: "
        f"epoch losses {'equal' if same else 'DIFFER'} ({', '.join(f'{x:.4f}' for x in f.losses['flow, running server'])}).",
        "",
        "| goal | measured | |",
        "| --- | --- | --- |",
    ]
    for variant, ref, most in GOALS:
        r = walls[variant] / walls[ref]
        lines.append(f"| {variant} / {ref} <= {most:.2f} | {r:.2f} | {'met' if r <= most else 'missed'} |")
    lines += ["", *breakdown(f), "", *in_the_way(f, walls)]
    return lines


def breakdown(f) -> list[str]:
    variants = [v for v in f.walls if v in f.parts]
    rows = list(dict.fromkeys(p for v in variants for p in f.parts[v]))
    lines = [
        "Where the time goes, one run of each (the flow's through `bench.startup_probe`: the same command with a few "
        "product functions wrapped to record when they run; the scripts' from their own marks), seconds:",
        "",
        f"| part | {' | '.join(variants)} |",
        f"| --- |{' --- |' * len(variants)}",
    ]
    for row in rows:
        cells = [f"{f.parts[v][row]:.2f}" if row in f.parts[v] else "-" for v in variants]
        lines.append(f"| {row} | {' | '.join(cells)} |")
    totals = [f"{sum(f.parts[v].values()):.2f}" for v in variants]
    lines.append(f"| **total (this run)** | {' | '.join(totals)} |")
    return lines


def differences(flow: dict[str, float], ref: str, reference: dict[str, float]) -> dict[str, float]:
    """The flow's parts minus the reference's, part by part (``ALIGNED``); parts only the flow has are whole."""
    out: dict[str, float] = {}
    for name, seconds in flow.items():
        key = ALIGNED[ref].get(name, name)
        out[key] = out.get(key, 0.0) + seconds
    for name, seconds in reference.items():
        out[name] = out.get(name, 0.0) - seconds
    return out


def in_the_way(f, walls: dict[str, float]) -> list[str]:
    """For each goal missed: by how much, and the parts of the flow's time that make it up, largest first."""
    lines = []
    for variant, ref, most in GOALS:
        excess = walls[variant] - most * walls[ref]
        if excess <= 0 or variant not in f.parts or ref not in f.parts:
            continue
        diff = differences(f.parts[variant], ref, f.parts[ref])
        top = sorted(((s, n) for n, s in diff.items() if s > 0.005), reverse=True)
        listed = "; ".join(f"{n} {s:+.2f} s{'' if n in f.parts[ref] else ' (the flow only)'}" for s, n in top[:7])
        lines.append(
            f"- {variant} / {ref}: missed by {excess:.2f} s ({walls[variant]:.2f} s against {most:.2f} x "
            f"{walls[ref]:.2f} s). Flow minus {ref}, part by part (one run each; what the flow does in its pre-flight "
            f"and units counts against the {ref}'s {'model build' if ref == 'bare script' else 'fit'}): {listed}."
        )
    running, temporary = (f.parts.get(v) for v in FLOWS)
    if lines and running and temporary:
        key = ("start-up: interpreter, imports", "pre-flight (flags, recipe, model on meta)")
        with_server, without = sum(temporary[k] for k in key), sum(running[k] for k in key)
        cpu = median(f.cpu[FLOWS[1]]) - median(f.cpu[FLOWS[0]])
        lines.append(
            f"- The temporary server starts while the command imports and runs its pre-flight: these took "
            f"{with_server:.2f} s beside it and {without:.2f} s with a running server (the server's start costs "
            f"{cpu:.1f} s more CPU per command, on {os.cpu_count()} cores shared with whatever else runs); its first "
            f"requests are slower too (flow start {temporary[FLOW_START]:.2f} s against {running[FLOW_START]:.2f} s)."
        )
    if lines:
        lines.insert(0, "What stands in the way of each goal missed:")
    return lines
