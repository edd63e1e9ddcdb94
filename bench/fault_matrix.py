"""The fault matrix of issue 44 on a real stack: what a deployment run's state history shows after an outage.

    python -m bench fault-matrix --outage 120 --watch 1200 --databases sqlite,postgres \
        --faults server,database,locked,shutdown

Per database, one stack (tests/integration/conftest.py's RunningStack: ``prefect server`` on SQLite or on a PostgreSQL
cluster of its own, `prefect deploy`, the heartbeat window, the product's worker with its reconciler), and per
fault one ``prefect deployment run train/default`` of a paced recipe that trains through the outage:

- ``server``: the Prefect server SIGKILLed (its whole process group) mid-unit, started again ``--outage`` s later on
  the same database and port; the worker and the flow run live on;
- ``database``: PostgreSQL SIGKILLed, started again on its cluster ``--outage`` s later; on SQLite, a second process
  holds a write transaction on the server's prefect.db for the whole outage (no write goes through);
- ``locked`` (SQLite only): that process holds the write transaction ``--lock-seconds`` at a time, 1 s apart, for the
  outage, while heartbeats, events, logs and state changes arrive (``database is locked``);
- ``twins``: no outage; a second ``prefect deployment run`` with the same parameters (the same ``run_name``) one
  second after the first (a user launching twice): one of them trains to the end, the other ends once, named for
  why, and is never rescheduled;
- ``shutdown``: under Prefect's own ``prefect worker start`` (with ``python -m deployments.recovery`` beside it, as
  ``make stack`` runs it), one SIGTERM at once to every process of the worker and of its flow run (a machine shutdown:
  systemd's stop of a control group); the machine comes back ``--outage`` s later (a new ``prefect worker start``).

Each run is then watched until ``--watch`` s after it completed (the later faults of the same stack happen meanwhile),
and its whole state history read. A row passes when the run completed exactly once, nothing followed Completed, no
attempt shows two Crashed states, every run again was one restart (``AwaitingRestart`` or ``Preempted``:
run_count - 1 of them), and its final weights are torch.equal to an uninterrupted run of the same config
(``python -m tests.run_lifecycle``, no Prefect); for ``twins`` the run that completed is the row's, and the other one
passes when it ended once (Cancelled or Failed), with no Crashed, no restart and nothing after its end. Opt-in: minutes per row, never part of the test suite.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from uuid import UUID

from bench.common import load_average, parser, progress, record
from training.run_states import AWAITING_RESTART, PREEMPTED

ROOT = Path(__file__).resolve().parents[1]

FAULTS = ("twins", "server", "database", "locked", "shutdown")  # run in this order: shutdown swaps the worker last
SQLITE_ONLY = {"locked"}
DATABASES = ("sqlite", "postgres")
STEP_SECONDS = 0.25
UNIT_STEPS = 40  # a checkpointed unit every 10 s
HOLDER = """
import sqlite3, sys, time
path, hold, gap, total = sys.argv[1], *map(float, sys.argv[2:5])
end, held = time.monotonic() + total, 0
conn = sqlite3.connect(path, timeout=120, isolation_level=None)
while time.monotonic() < end:
    conn.execute("BEGIN IMMEDIATE")
    time.sleep(max(0.0, min(hold, end - time.monotonic())))
    conn.execute("ROLLBACK")
    held += 1
    time.sleep(gap)
print(f"held the write lock {held} times", flush=True)
"""


@dataclass
class Row:
    database: str
    fault: str
    run_id: UUID | None = None
    folder: Path | None = None
    fault_at: datetime | None = None
    recovered_at: float = 0.0  # monotonic: the outage's end
    completed_at: float | None = None  # monotonic
    struck_at: float = 0.0
    history: list = field(default_factory=list)  # (timestamp, type, name, message) oldest first
    run_count: int = 0
    equal: bool | None = None
    note: str = ""
    twin_id: UUID | None = None  # twins: the other flow run of the same run_name
    twin_history: list = field(default_factory=list)
    twin_run_count: int = 0


def config(folder: Path, run_name: str, record_dir: Path, steps: int) -> dict:
    from tests.integration.stack_client import SYNTHETIC

    args = {"num_samples": 256, "hidden": 256, "record_dir": str(record_dir), "step_seconds": STEP_SECONDS}
    return {**SYNTHETIC, "run_name": run_name, "save_folder": str(folder), "recipe": "tests.recipes_for_tests:PacedRecipe",
            "recipe_args": args, "max_duration": f"{steps}ba", "save_interval": f"{UNIT_STEPS}ba"}  # fmt: skip


def start_reference(scratch: Path, steps: int, env: dict[str, str]) -> subprocess.Popen:
    """The uninterrupted run, trained without Prefect while the stacks run (same config, same threads)."""
    cfg = config(scratch / "reference", "ref", scratch / "reference-ids", steps)
    flags = [f for k, v in cfg.items() for f in (f"--{k}", v if isinstance(v, str) else json.dumps(v))]
    log = open(scratch / "reference.log", "wb")  # noqa: SIM115 - the child's, closed with the scratch folder
    command = [sys.executable, "-m", "tests.run_lifecycle", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def hold_sqlite(running, hold: float, gap: float, total: float) -> subprocess.Popen:
    db = running.stack.home / "prefect.db"
    log = running.logs / f"holder-{time.monotonic_ns()}.log"
    return running._track(_spawn([sys.executable, "-c", HOLDER, str(db), str(hold), str(gap), str(total)],
                                 dict(os.environ), log))  # fmt: skip


def restart_server(running, why: str) -> None:
    from deployments import stack as stacks

    running.server = running._track(stacks.start_server(running.stack, running.logs / f"server-after-{why}.log"))
    stacks.wait_healthy(running.stack, running.server)


def restart_postgres(running) -> None:
    """PostgreSQL again on its cluster; a killed postmaster's backends leave by themselves, until then it refuses."""
    from deployments import stack as stacks

    deadline = time.monotonic() + 120
    while True:
        server = running.postgres.start(running.logs / "postgres-again.log")
        try:
            running.postgres.wait_ready(server, timeout=10)
            running.postgres_server = running._track(server)
            return
        except Exception:
            stacks.stop(server, signal.SIGINT)
            if time.monotonic() > deadline:
                raise


def prefect_worker(running) -> None:
    """Prefect's own process worker for the pool, and the reconciler beside it (what `make stack` runs)."""
    from deployments import stack as stacks

    env = running.stack.env(OMP_NUM_THREADS=str(stacks.worker_threads()))
    log = running.logs / f"prefect-worker-{len(running.started)}.log"
    running.worker = running._track(
        _spawn([sys.executable, "-m", "prefect", "worker", "start", "--pool", stacks.POOL], env, log)
    )


def strike(running, row: Row, outage: float, lock_seconds: float) -> str:
    """Does the row's fault to the stack and brings the stack back after ``outage`` s; what it saw, in words."""
    from deployments import stack as stacks

    if row.fault == "server":
        os.killpg(running.server.pid, signal.SIGKILL)
        running.server.wait(timeout=30)
        time.sleep(outage)
        restart_server(running, "kill")
        return "server SIGKILLed"
    if row.fault == "twins":
        return "a second run of the same run_name 1s after the first"
    if row.fault == "database" and running.database == "postgres":
        os.kill(running.postgres_server.pid, signal.SIGKILL)
        running.postgres_server.wait(timeout=30)
        time.sleep(outage)
        restart_postgres(running)
        return "postmaster SIGKILLed"
    if row.fault in ("database", "locked"):
        hold, gap = (outage, 0.0) if row.fault == "database" else (lock_seconds, 1.0)
        hold_sqlite(running, hold, gap, outage).wait(timeout=outage + 300)
        return f"write transaction on prefect.db held {hold:g}s at a time, {gap:g}s apart"
    pids = [running.worker.pid, *stacks.descendants(running.worker.pid)]
    for pid in pids:  # one SIGTERM to every process of the machine, at once
        os.kill(pid, signal.SIGTERM)
    try:
        running.worker.wait(timeout=90)
    except subprocess.TimeoutExpired:
        stacks.stop(running.worker, signal.SIGKILL)
    left, code = [pid for pid in pids if _alive(pid)], running.worker.returncode
    time.sleep(outage)
    prefect_worker(running)  # the machine is back
    return f"SIGTERM to {len(pids)} processes at once; the worker exited {code}, {len(left)} left"


def _alive(pid: int) -> bool:
    from tests.procs import alive

    return alive(pid)


def deployment_run(running, params: str) -> UUID:
    """`prefect deployment run train/default --params ...`: the flow run's id."""
    from tests.integration.stack_client import prefect_cli, run_id_from

    done = prefect_cli(running.stack, "deployment", "run", "train/default", "--params", params)
    if done.returncode != 0:
        raise RuntimeError(f"prefect deployment run exited {done.returncode}: {done.stdout[-2000:]}{done.stderr}")
    return run_id_from(done.stdout)


def start_run(running, row: Row, scratch: Path, steps: int) -> None:
    """`prefect deployment run train/default`, then waits until it trains a step after its first checkpoint; for
    ``twins`` the same command again one second after the first, and no wait."""
    from tests.integration.stack_client import wait_for

    name = f"{row.database}-{row.fault}"
    row.folder, record_dir = scratch / name / "runs", scratch / name / "ids"
    params = json.dumps({"config": config(row.folder, "fm", record_dir, steps)})
    row.run_id = deployment_run(running, params)
    if row.fault == "twins":
        time.sleep(1.0)
        row.twin_id = deployment_run(running, params)
        return
    phase = record_dir / "phase"
    wait_for(lambda: (row.folder / "fm" / "latest").exists() and phase.exists() and phase.read_text().startswith("step"),
             600, f"{name}: a step after the first checkpoint")  # fmt: skip


def wait_completed(running, row: Row, timeout: float) -> None:
    from prefect.client.schemas.objects import StateType

    from tests.integration.stack_client import read_run

    ends = {StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED}
    runs = [r for r in (row.run_id, row.twin_id) if r is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [read_run(running, r).state for r in runs]
        except Exception:  # the API is still coming back
            states = []
        if states and all(state is not None and state.type in ends for state in states):
            row.completed_at = time.monotonic()
            return
        time.sleep(2)
    row.note += f"; not ended {timeout:.0f}s after the outage"


def read_history(running, row: Row) -> None:
    """The row's run's whole state history and run_count; for ``twins`` the one that Completed is the row's run."""
    from tests.integration.stack_client import client, read_run

    def of(run_id: UUID) -> tuple[list, int]:
        with client(running) as c:
            states = sorted(c.read_flow_run_states(run_id), key=lambda s: s.timestamp)
        return [(s.timestamp, s.type.value, s.name, s.message or "") for s in states], read_run(
            running, run_id
        ).run_count

    assert row.run_id is not None
    row.history, row.run_count = of(row.run_id)
    if row.twin_id is not None:
        row.twin_history, row.twin_run_count = of(row.twin_id)
        if row.twin_history and row.twin_history[-1][1] == "COMPLETED":
            row.run_id, row.twin_id = row.twin_id, row.run_id
            row.history, row.twin_history = row.twin_history, row.history
            row.run_count, row.twin_run_count = row.twin_run_count, row.run_count


def run_fault(running, row: Row, args, scratch: Path, steps: int) -> None:
    progress(f"{row.database}/{row.fault}: starting the run")
    if row.fault == "shutdown":
        from deployments import stack as stacks

        stacks.stop(running.worker)  # the product's worker, idle: Prefect's own takes the run
        prefect_worker(running)
        running._track(stacks.start_recovery(running.stack, running.logs / "recovery.log"))  # the stack's reconciler
    start_run(running, row, scratch, steps)
    row.fault_at, row.struck_at = datetime.now(UTC), time.monotonic()
    progress(f"{row.database}/{row.fault}: run {row.run_id} trains; the fault now, for {args.outage:g}s")
    row.note = strike(running, row, args.outage, args.lock_seconds)
    row.recovered_at = time.monotonic()
    progress(f"{row.database}/{row.fault}: back ({row.note}); waiting for the run to end")
    wait_completed(running, row, args.outage + args.train_seconds + 600)


def run_database(database: str, args, scratch: Path, steps: int) -> list[Row]:
    from tests.integration.conftest import RunningStack

    home, logs = Path(tempfile.mkdtemp(prefix="fm-home-", dir=scratch)), scratch / f"logs-{database}"
    logs.mkdir()
    running = RunningStack(home=home, logs=logs, allowed_root=scratch, database=database)
    rows = [Row(database, f) for f in FAULTS if f in args.faults and not (f in SQLITE_ONLY and database != "sqlite")]
    try:
        progress(f"{database}: starting the stack")
        running.up()
        for row in rows:
            try:
                run_fault(running, row, args, scratch, steps)
            except Exception as exc:  # the row says so; the next fault still runs
                row.note += f"; {type(exc).__name__}: {str(exc)[:300]}"
                progress(f"{database}/{row.fault}: {row.note}")
        ends = [r.completed_at for r in rows if r.completed_at is not None]
        if ends:
            wait = max(ends) + args.watch - time.monotonic()
            progress(f"{database}: watching the completed runs for {max(wait, 0):.0f}s more")
            time.sleep(max(wait, 0))
        for row in rows:
            if row.run_id is not None:
                read_history(running, row)
    finally:
        survivors = running.down()
        if survivors:
            progress(f"{database}: processes left by the stack: {survivors}")
    return rows


def verdict(history: list, run_count: int, equal: bool | None) -> list[str]:
    """What is wrong with a run's state history (oldest first: (timestamp, type, name)); empty when nothing is."""
    names, types = [h[2] for h in history], [h[1] for h in history]
    wrong = []
    if not types or types[-1] != "COMPLETED":
        wrong.append(f"ended {names[-1] if names else 'nowhere'}")
    if types.count("COMPLETED") > 1:
        wrong.append(f"Completed {types.count('COMPLETED')} times")
    if "COMPLETED" in types and types.index("COMPLETED") < len(types) - 1:
        wrong.append("states after Completed: " + ", ".join(names[types.index("COMPLETED") + 1 :]))
    crashed_per_attempt, crashed = [], 0
    for kind in types:
        if kind == "RUNNING":
            crashed_per_attempt.append(crashed)
            crashed = 0
        crashed += kind == "CRASHED"
    if max([*crashed_per_attempt, crashed]) > 1:
        wrong.append("two Crashed for one attempt")
    unrestarted = [
        i for i, kind in enumerate(types) if kind == "CRASHED" and AWAITING_RESTART not in names[i + 1 : i + 2]
    ]
    if unrestarted:  # a Crashed no restart followed: the attempt lived on (or the run stayed dead)
        wrong.append(
            f"Crashed without a restart ({names[unrestarted[0] + 1] if unrestarted[0] + 1 < len(names) else 'last'} next)"
        )
    restarts = names.count(AWAITING_RESTART) + names.count(PREEMPTED)
    if restarts != max(run_count - 1, 0) or types.count("RUNNING") != run_count:
        wrong.append(f"run_count {run_count}, {types.count('RUNNING')} Running, {restarts} restarts")
    if equal is not True:
        wrong.append("weights differ" if equal is False else "no weights")
    return wrong


def twin_verdict(history: list, run_count: int) -> list[str]:
    """What is wrong with the history of the twin that lost (oldest first): it must end once, Cancelled or Failed,
    with no Crashed, no restart and nothing after its end."""
    names, types = [h[2] for h in history], [h[1] for h in history]
    wrong = []
    ends = [i for i, kind in enumerate(types) if kind in ("COMPLETED", "CANCELLED", "FAILED")]
    if not ends or types[ends[0]] == "COMPLETED":
        wrong.append(f"the other run ended {names[ends[0]] if ends else names[-1] if names else 'nowhere'}")
    if ends and ends[0] < len(types) - 1:
        wrong.append("the other run's states after its end: " + ", ".join(names[ends[0] + 1 :]))
    if "CRASHED" in types or AWAITING_RESTART in names or PREEMPTED in names or run_count > 1:
        wrong.append(f"the other run was marked Crashed or restarted ({', '.join(names)}; run_count {run_count})")
    return wrong


def weights_equal(folder: Path | None, reference: Path) -> bool | None:
    import torch

    from tests.integration.test_deployment_preemption import model_of

    if folder is None:
        return None
    try:
        got, want = model_of(folder, "fm"), model_of(reference, "ref")
    except Exception:
        return None
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def line(row: Row) -> str:
    wrong = verdict(row.history, row.run_count, row.equal)
    if row.twin_id is not None:
        wrong += twin_verdict(row.twin_history, row.twin_run_count)
        other = " > ".join(h[2] + (f" ({h[3][:90]})" if h[1] in ("CANCELLED", "FAILED", "CRASHED") else "")
                           for h in row.twin_history)  # fmt: skip
        row.note += f"; the other run: {other}, run_count {row.twin_run_count}"
    after = [h for h in row.history if row.fault_at and h[0] > row.fault_at]
    first = f"{after[0][2]} at +{(after[0][0] - row.fault_at).total_seconds():.0f}s" if after else "-"
    done = f"{row.completed_at - row.struck_at:.0f}" if row.completed_at else "-"
    watched = f"{time.monotonic() - row.completed_at:.0f}" if row.completed_at else "-"
    history = " > ".join(h[2] + (f" ({h[3][:70]})" if h[1] == "CRASHED" else "") for h in row.history)
    restarts = sum(h[2] in (AWAITING_RESTART, PREEMPTED) for h in row.history)
    crashed = sum(h[1] == "CRASHED" for h in row.history)
    return (f"| {row.database} | {row.fault} | {row.history[-1][2] if row.history else '-'} | {history} | "
            f"{row.run_count} | {restarts} | {crashed} | {row.equal} | {first} | {done} | {watched} | "
            f"{'ok' if not wrong else 'FAIL: ' + '; '.join(wrong)} | {row.note.strip('; ')} |")  # fmt: skip


def main(argv: list[str]) -> None:
    p = parser("fault-matrix", __doc__.split("\n\n")[0])
    p.add_argument("--outage", type=float, default=120.0, help="seconds each fault lasts")
    p.add_argument("--watch", type=float, default=1200.0, help="seconds each run is watched after it completed")
    p.add_argument("--databases", default="sqlite,postgres", help=f"comma-separated, of {','.join(DATABASES)}")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    p.add_argument("--lock-seconds", type=float, default=8.0, help="locked: how long each write transaction is held")
    p.add_argument("--train-seconds", type=float, default=None, help="each run's training (default: outage + 90)")
    args = p.parse_args(argv)
    args.databases, args.faults = args.databases.split(","), args.faults.split(",")
    for option, given, allowed in (("--databases", args.databases, DATABASES), ("--faults", args.faults, FAULTS)):
        if bad := [g for g in given if g not in allowed]:
            p.error(f"{option} {','.join(bad)}: not one of {','.join(allowed)}; e.g. {option} {','.join(allowed)}")
    if args.outage < 0 or args.watch < 0 or args.lock_seconds <= 0:
        p.error("--outage and --watch must be >= 0 and --lock-seconds > 0 (seconds)")
    args.train_seconds = args.train_seconds or args.outage + 90
    steps = UNIT_STEPS * math.ceil(args.train_seconds / STEP_SECONDS / UNIT_STEPS)
    load = load_average()
    scratch = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    try:
        run(args, scratch, steps, load)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args, scratch: Path, steps: int, load: str) -> None:
    from deployments import stack as stacks
    from tests.conftest import TEST_RECIPES

    env = {**os.environ, "OMP_NUM_THREADS": str(stacks.worker_threads()), "TRAIN_ALLOWED_RECIPES": TEST_RECIPES,
           "TRAIN_ALLOWED_ROOTS": str(scratch), "PYTHONPATH": str(ROOT)}  # fmt: skip
    reference = start_reference(scratch, steps, env)
    rows = [row for database in args.databases for row in run_database(database, args, scratch, steps)]
    if reference.wait(timeout=args.train_seconds * 3 + 600) != 0:
        progress("the uninterrupted run failed: " + (scratch / "reference.log").read_text()[-2000:])
    for row in rows:
        row.equal = weights_equal(row.folder, scratch / "reference")
    header = ("| database | fault | final | state history | run_count | restarts | Crashed | weights equal | "
              "first state after the fault | fault to end (s) | watched after (s) | verdict | fault |")  # fmt: skip
    lines = [
        f"{steps} steps of {STEP_SECONDS}s, a unit every {UNIT_STEPS}; outage {args.outage:g}s, watch {args.watch:g}s",
        "",
        header,
        "|" + " --- |" * 13,
        *[line(row) for row in rows],
    ]
    record("Fault matrix (issue 44)", lines, load)
