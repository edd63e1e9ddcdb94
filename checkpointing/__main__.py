"""Checkpoints for people: ``python -m checkpointing ls|verify|export <uri>``.

    python -m checkpointing ls runs/exp1                    # table of a run's checkpoints
    python -m checkpointing ls runs/sweep1                  # a sweep folder: table of its trials, the best one
    python -m checkpointing ls runs/exp1 --best loss --order min   # those reporting loss, lowest first
    python -m checkpointing verify runs/exp1                # sha256 of every file; exit 1 if any is bad (a
                                                            # dead writer's uncommitted leftover is not: torn.py)
    python -m checkpointing verify runs/exp1 --name ep3-ba24-sa768   # one checkpoint
    python -m checkpointing export runs/exp1 model.pt       # weights + recipe, recipe_args, version
    python -m checkpointing export runs/exp1 model.safetensors     # the same as safetensors

A URI is a run folder (<save_folder>/<run_name>) or, for verify and export, one checkpoint folder
(<save_folder>/<run_name>/checkpoints/<name>). --storage-options takes fsspec options as JSON (for
another S3 endpoint, say); credentials belong in the standard AWS variables, and the value is never
printed. Names, metrics and messages read from a bucket are printed escaped (``printable``): a name may hold
terminal escapes or a newline, and must not set the terminal's title or forge a row of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import CheckpointError, StorageError
from checkpointing.host_tier import gc
from checkpointing.io.protocols import check_store_url
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import printable
from checkpointing.ledger import EVENTS, Event, Ledger
from checkpointing.manifest import is_valid_name
from checkpointing.store import CHECKPOINTS, POINTER, CheckpointInfo, CheckpointStore, validate_name
from checkpointing.torn import leftover, torn_folders
from checkpointing.uris import split_run_uri


def _run_store(uri: str, options: dict) -> tuple[CheckpointStore, str | None]:
    """The store of a run URI, and the checkpoint name if the URI names one."""
    folder, run, name = split_run_uri(check_store_url(uri, "uri"))
    return CheckpointStore(folder, run, storage_options=options), name


HEADER = ("name", "epoch", "step", "samples", "size MB", "verified", "latest")


def cmd_ls(args, options) -> int:
    sweep = Storage(check_store_url(args.uri, "uri"), options)
    if sweep.exists(f"{SWEEP}/{EVENTS}"):
        return _ls_sweep(Ledger(sweep, SWEEP))
    store, _ = _run_store(args.uri, options)
    if not (store.storage.exists(POINTER) or store.storage.exists(CHECKPOINTS)):
        store.storage.require_bucket()  # a mistyped bucket is said as such, not as an empty run
        print(
            f"error: no run at {printable(store.uri)} (neither '{POINTER}' nor '{CHECKPOINTS}/' there)", file=sys.stderr
        )
        return 2
    if args.best:
        return _ls_best(store, args.best, args.order)
    pointer = (store.read_pointer() or {}).get("name")
    infos = store.list()
    _print_table([HEADER, *(_row(store, info, pointer) for info in infos)])
    if not infos:
        print(f"(no checkpoints in {store.uri})")
    set_aside = store.set_aside(infos)  # the manifests just read, not a second listing
    if set_aside:
        print(f"(set aside by a roll-back: kept, never resumed from: {', '.join(map(printable, set_aside))})")
    return 0


def _ls_best(store: CheckpointStore, metric: str, order: str) -> int:
    """``ls --best METRIC``: the checkpoints that report METRIC, best first, with its value beside the name."""
    best = store.best(metric, order)
    if not best:
        reported = sorted({printable(m) for info in store.list() for m in info.metrics})
        known = f"they report: {', '.join(reported)}" if reported else "none of its checkpoints reports metrics"
        print(f"error: no checkpoint in {printable(store.uri)} reports metric {metric!r} ({known})", file=sys.stderr)
        return 2
    pointer = (store.read_pointer() or {}).get("name")
    rows: list[tuple[str, ...]] = [(HEADER[0], metric, *HEADER[1:])]
    for info in best:
        name, *rest = _row(store, info, pointer)
        rows.append((name, f"{info.metrics[metric]:.6g}", *rest))
    _print_table(rows)
    return 0


# -- a sweep folder: its trials, folded from the ledger (training/sweep/study.py gives the events their meaning) ----
SWEEP = "sweep"
_STATES = {
    "segment_started": "running",
    "trial_paused": "paused",
    "trial_promoted": "pending",
    "trial_stopped": "stopped",
    "trial_completed": "completed",
    "exploit": "pending",
}


@dataclass
class _Trial:
    index: int
    state: str = "pending"
    runs: list[str] = field(default_factory=list)
    units: dict[int, tuple[dict[str, Any], str]] = field(default_factory=dict)  # unit -> (metrics, checkpoint)


def _ls_sweep(ledger: Ledger) -> int:
    """``ls`` on a sweep folder: one row per trial, then the best trial. Values from the ledger are untrusted: names
    print only when they are valid names, numbers only as numbers."""
    events = ledger.read()
    started = next((e.body for e in events if e.kind == "sweep_started"), {})
    spec: dict[str, Any] = started["spec"] if isinstance(started.get("spec"), dict) else {}
    metric = _name(spec.get("metric")) or "eval_loss"
    mode = "max" if spec.get("mode") == "max" else "min"
    trials = _fold(events)
    rows: list[tuple[str, ...]] = [
        ("trial", "state", "runs", "units", f"last {metric}", f"best {metric}", "best checkpoint")
    ]
    for name, t in sorted(trials.items(), key=lambda item: item[1].index):
        best = _best(t, metric, mode)
        last = t.units[max(t.units)][0].get(metric) if t.units else None
        rows.append(
            (
                name,
                t.state,
                ",".join(t.runs),
                str(max(t.units, default=0)),
                _number(last),
                _number(best[0] if best else None),
                best[1] if best else "",
            )
        )
    _print_table(rows)
    print(_best_line(events, trials, metric, mode))
    return 0


def _fold(events: list[Event]) -> dict[str, _Trial]:
    trials: dict[str, _Trial] = {}
    for e in events:
        name = _name(e.body.get("trial"))
        if e.kind == "trial_created" and name:
            index: Any = e.body.get("index")
            trials[name] = _Trial(int(index) if _is_number(index) else len(trials))
        t = trials.get(name)
        if t is None:
            continue
        run = _name(e.body.get("run_name"))
        if run and run not in t.runs and e.kind in ("segment_started", "exploit"):
            t.runs.append(run)
        t.state = _STATES.get(e.kind, t.state)
        if e.kind == "segment_finished":
            t.state = "paused" if e.body.get("status") == "ok" else "failed"
            units = e.body.get("units")
            for unit in units if isinstance(units, list) else []:
                if isinstance(unit, dict) and _is_number(unit.get("unit")) and isinstance(unit.get("metrics"), dict):
                    t.units[int(unit["unit"])] = (unit["metrics"], _checkpoint(unit.get("checkpoint")))
    return trials


def _best(t: _Trial, metric: str, mode: str) -> tuple[float, str] | None:
    scored = [(float(m[metric]), unit, ckpt) for unit, (m, ckpt) in t.units.items() if _is_number(m.get(metric))]
    if not scored:
        return None
    value, _, ckpt = min(scored, key=lambda s: (s[0] if mode == "min" else -s[0], s[1]))
    return value, ckpt


def _best_line(events: list[Event], trials: dict[str, _Trial], metric: str, mode: str) -> str:
    finished = next((e.body for e in reversed(events) if e.kind == "sweep_finished"), None)
    if finished and _name(finished.get("best_trial")):
        shown = _number(finished.get("value"))
        return f"best trial: {_name(finished['best_trial'])} ({metric} {shown}) at {_checkpoint(finished.get('best_checkpoint'))}"
    found = [
        (b[0] if mode == "min" else -b[0], t.index, name, b)
        for name, t in trials.items()
        if (b := _best(t, metric, mode))
    ]
    if not found:
        return f"best trial: none yet (no trial reports {metric})"
    _, _, name, (value, ckpt) = min(found)
    return f"best trial so far: {name} ({metric} {_number(value)}) at {ckpt}"


def _name(value: Any) -> str:
    return value if isinstance(value, str) and is_valid_name(value) else ""


def _is_number(value: Any) -> bool:
    """A finite JSON number (NaN, a diverged trial's loss, ranks nowhere)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> str:
    return f"{value:.6g}" if _is_number(value) else ""


def _checkpoint(uri: Any) -> str:
    """A checkpoint URI from the ledger, shown only when it ends in ``<run>/checkpoints/<name>`` of valid names."""
    parts = uri.rstrip("/").split("/") if isinstance(uri, str) else []
    ok = len(parts) >= 3 and parts[-2] == CHECKPOINTS and is_valid_name(parts[-1]) and is_valid_name(parts[-3])
    return printable(uri) if ok else "(not a checkpoint URI)"


def _row(store: CheckpointStore, info: CheckpointInfo, pointer: str | None) -> tuple[str, ...]:
    p = info.progress
    return (
        info.name,
        str(p.get("epoch", "")),
        str(p.get("step", "")),
        str(p.get("samples_seen", "")),
        f"{info.size_bytes / 1e6:.1f}",
        "no" if store.check(info) else "yes",
        "*" if info.name == pointer else "",
    )


def _print_table(rows: list[tuple[str, ...]]) -> None:
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip())


def cmd_verify(args, options) -> int:
    store, name = _run_store(args.uri, options)
    name = validate_name(args.name, "--name") if args.name else name
    listed = [i.name for i in store.list()]  # oldest first; then the folders whose manifest cannot be read (BAD)
    names = [name] if name else listed + [n for n in store.folders() if n not in listed]
    if not names:
        print(f"no checkpoints in {printable(store.uri)}", file=sys.stderr)
        return 1
    torn_names, claim = set(torn_folders(store)), store.fence.newest()  # a dead writer's leftover is not damage
    named = (store.read_pointer() or {}).get("name")
    bad = 0
    for n in names:
        problems = store.check(n, deep=True)
        left = leftover(store, n, torn_names, claim, named) if problems else None
        print(printable(left or f"{n}: {'ok' if not problems else 'BAD: ' + '; '.join(problems)}"))
        bad += bool(problems) and left is None
    return 1 if bad else 0


def cmd_export(args, options) -> int:
    check_store_url(args.uri, "uri")
    check_store_url(args.out, "out")
    from checkpointing.export import export_checkpoint  # torch and safetensors: only export needs them

    print(printable(export_checkpoint(args.uri, args.out, storage_options=options, fmt=args.format)))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpointing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # --storage-options may come before or after the command; SUPPRESS keeps a command from resetting it. The
    # training command's spelling (--storage_options, pydantic-settings' flag) is taken too: one copied from it works.
    spellings = ("--storage-options", "--storage_options")
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        *spellings, dest="storage_options", default=argparse.SUPPRESS, help="fsspec options as JSON (never printed)"
    )
    parser.add_argument(*spellings, dest="storage_options", default="{}", help="fsspec options as JSON (never printed)")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "ls",
        parents=[options],
        help="list a run's checkpoints ('verified': every file there with the "
        "size its manifest gives; verify also checks sha256)",
    )
    ls.add_argument("uri")
    ls.add_argument(
        "--best",
        metavar="METRIC",
        help="only the checkpoints that report this unit metric (e.g. loss), best first, with its value; "
        "checkpoints set aside by a roll-back are left out",
    )
    ls.add_argument(
        "--order", choices=("max", "min"), default="max", help="with --best: higher (max, default) or lower is better"
    )
    verify = sub.add_parser("verify", parents=[options], help="check every file's sha256; exit 1 if any is bad")
    verify.add_argument("uri")
    verify.add_argument("--name", help="verify only this checkpoint of the run")
    export = sub.add_parser(
        "export", parents=[options], help="write the weights, with the recipe and recipe_args that rebuild the model"
    )
    export.add_argument("uri")
    export.add_argument("out")
    export.add_argument(
        "--format",
        choices=("torch", "safetensors"),  # checkpointing.export.FORMATS, without importing torch for ls
        help="torch (default) or safetensors (the default for a .safetensors name); the recipe, recipe_args and "
        "product version go beside the weights",
    )
    gc.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        options = json.loads(args.storage_options)
        if not isinstance(options, dict):
            raise ValueError
    except ValueError:
        print(
            "error: --storage-options must be a JSON object, e.g. "
            '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:5555"}}\'',
            file=sys.stderr,
        )
        return 2
    try:
        command = {"ls": cmd_ls, "verify": cmd_verify, "export": cmd_export, "gc": gc.cmd_gc}[args.command]
        return command(args, options)
    except (CheckpointError, StorageError, ValueError, OSError) as exc:  # LedgerError is a CheckpointError
        print(f"error: {printable(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
