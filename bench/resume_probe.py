"""``python -m bench.resume_probe MARKS.json -- <flags of python -m flows.train>``: a relaunch, timed from outside.

Runs ``flows.train.main`` unchanged after wrapping (not editing) a few product functions so that each records
when it was entered and left. The wrappers cost microseconds; nothing in training/, checkpointing/, flows/
or tasks/ is modified. The first marks are taken before anything heavy is imported.
"""

import time

_T0 = time.time()

import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

MARKS: dict[str, list[float]] = {"probe start": [_T0]}


def _mark(name: str, t: float | None = None) -> None:
    MARKS.setdefault(name, []).append(time.time() if t is None else t)


def _wrap(owner, attr: str, name: str) -> None:
    """Records '<name> in' and '<name> out' around every call of ``owner.attr``."""
    inner = getattr(owner, attr)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        _mark(f"{name} in")
        try:
            return inner(*args, **kwargs)
        finally:
            _mark(f"{name} out")

    setattr(owner, attr, staticmethod(timed) if isinstance(owner.__dict__.get(attr), staticmethod) else timed)


# (module, attribute, mark): the product functions whose calls mark the relaunch's parts (bench/resume_latency.py);
# tests/unit/test_bench_probes.py checks each still exists, so a rename fails a test and not the next benchmark run
TARGETS = [
    ("flows.cli", "check_before_prefect", "load recipe"),  # main(): checks the recipe before Prefect starts
    ("flows.train", "check_restart_cap", "flow body"),  # the flow body's first call
    ("flows.train", "unit_task", "unit task"),  # after planning: latest, claim, progress artifact
    ("training.run", "run_unit", "run unit"),  # the task body
    ("training.unit.session", "restore", "restore"),  # build + load
    ("training.unit.session", "_load_into", "load into"),
    ("checkpointing.store", "CheckpointStore.load", "load"),  # after resolving which checkpoint
    ("checkpointing.io.storage", "Storage.get_hashed", "read+verify"),  # download + sha256 of one file
    ("checkpointing.store", "safe_load", "unpickle"),
    ("training.unit.session", "_apply", "apply state"),  # load_state_dict, RNG, progress
    ("training.unit.loop", "_loader", "loader"),  # sampler (the epoch's order) + DataLoader
    ("training.unit.loop", "_step", "step"),
]


def target(module: str, attribute: str) -> tuple[object, str]:
    """The object that holds ``attribute`` (a module, or a class for ``Class.method``) and the attribute's name."""
    import importlib

    owner: object = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def main() -> int:
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    import flows.train  # everything the relaunch imports before it can do anything

    _mark("imports done")
    for module, attribute, mark in TARGETS:
        _wrap(*target(module, attribute), mark)
    try:
        return flows.train.main(argv)
    finally:
        with open(out, "w") as f:
            json.dump(MARKS, f)


if __name__ == "__main__":
    sys.exit(main())
