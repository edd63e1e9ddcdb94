"""python -m bench [all | NAME ...] [flags of one NAME]: runs benchmarks, appends their figures to bench/RESULTS.md.

python -m bench overhead --help      # a benchmark's flags (longer runs, other sizes, profiling)
"""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "skip": "bench.skip_cost",
    "store": "bench.store_throughput",
    "overhead": "bench.overhead",
    "resume": "bench.resume_latency",
    "peer": "bench.peer_lightning",
    "cli": "bench.cli_startup",
    "sharded": "bench.sharded",
    "accumulation": "bench.accumulation",
    "gpt": "bench.gpt",
    "startup": "bench.startup",
    "units": "bench.units",
    "preemption": "bench.preemption",
    "snapshots": "bench.snapshots",
    "contention": "bench.contention",
    "gpu_snapshot": "bench.gpu_snapshot",
    "streaming": "bench.streaming",
    "formats": "bench.formats",
    "metrics": "bench.metrics",
    "sweep": "bench.sweep_vs_ray",
    "fault-matrix": "bench.fault_matrix",
}


def main(argv: list[str]) -> int:
    first_flag = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    names, flags = argv[:first_flag] or ["all"], argv[first_flag:]
    chosen = list(BENCHES) if names == ["all"] else names
    unknown = [n for n in chosen if n not in BENCHES]
    if unknown or (flags and len(chosen) != 1):
        print(
            f"usage: python -m bench [all | NAME ...] [flags of one NAME]; NAME is one of {', '.join(BENCHES)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "; flags go with a single benchmark"),
            file=sys.stderr,
        )
        return 2
    from bench.common import leave_nothing_behind

    leave_nothing_behind()
    for name in chosen:
        importlib.import_module(BENCHES[name]).main(flags)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
