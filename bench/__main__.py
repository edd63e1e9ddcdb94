"""python -m bench [all|skip|store|overhead|resume|peer]: runs benchmarks, appends to bench/RESULTS.md."""

from __future__ import annotations

import importlib
import sys

BENCHES = {"skip": "bench.skip_cost", "store": "bench.store_throughput", "overhead": "bench.overhead",
           "resume": "bench.resume_latency", "peer": "bench.peer_lightning"}


def main(argv: list[str]) -> int:
    names = argv or ["all"]
    chosen = list(BENCHES) if names == ["all"] else names
    unknown = [n for n in chosen if n not in BENCHES]
    if unknown:
        print(f"error: unknown benchmark(s) {unknown}: choose from all, {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    for name in chosen:
        importlib.import_module(BENCHES[name]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
