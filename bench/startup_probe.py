"""``python -m bench.startup_probe MARKS.json -- <flags of python -m flows.train>``: the whole command, timed inside.

Does what ``python -m flows.train`` does, in the same order (``flows.launch.start`` first, as the package's
``__init__`` does for the real command, then the imports, then ``flows.train.main``), after wrapping (not editing)
a few product functions so that each records when it was entered and left, and what a unit reported. The wrappers
cost microseconds; nothing in flows/, tasks/, training/ or checkpointing/ is modified. The parent adds the
process's start and exit times (bench/startup.py).
"""

import time

_T0 = time.time()

import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

MARKS: dict[str, list[float]] = {"probe start": [_T0]}
UNITS: list[dict[str, float]] = []  # per unit: train_seconds, checkpoint_seconds (the product's own metrics)


def _mark(name: str) -> None:
    MARKS.setdefault(name, []).append(time.time())


def _wrap(owner, attr: str, name: str, keep_result=None) -> None:
    """Records '<name> in' and '<name> out' around every call of ``owner.attr``."""
    inner = getattr(owner, attr)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        _mark(f"{name} in")
        try:
            result = inner(*args, **kwargs)
            if keep_result is not None:
                keep_result(result)
            return result
        finally:
            _mark(f"{name} out")

    setattr(owner, attr, timed)


def _unit_metrics(result) -> None:
    metrics = getattr(result, "metrics", {}) or {}
    UNITS.append({k: float(metrics.get(k, 0.0)) for k in ("train_seconds", "checkpoint_seconds")})


def main() -> int:
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    from flows import launch

    launch.start("flows.train", argv)  # what flows/__init__.py does for `python -m flows.train`
    _mark("early start done")
    import flows.train  # everything the command imports before main()

    _mark("imports done")
    from flows import cli, server

    train_unit = sys.modules["tasks.train_unit"]  # the package `tasks` shadows the module's name
    _wrap(cli, "check_before_prefect", "pre-flight")
    _wrap(server.TemporaryServer, "wait_ready", "server wait")
    _wrap(server, "_drain_to_api", "drain")
    _wrap(server.TemporaryServer, "stop", "server stop")
    _wrap(flows.train, "check_restart_cap", "flow body")  # the flow body's first call
    _wrap(train_unit, "execute_unit", "unit", _unit_metrics)
    _wrap(train_unit, "evaluate_checkpoint", "evaluation")
    _wrap(flows.train, "done_line", "flow returned")
    try:
        return flows.train.main(argv)
    finally:
        _mark("main returned")
        with open(out, "w") as f:
            json.dump({"marks": MARKS, "units": UNITS}, f)


if __name__ == "__main__":
    sys.exit(main())
