"""How long each test file took in a full run (tests/file_seconds.json), for tests/conftest.py to collect the longest
first: `make test`'s xdist workers take whole files in collection order, and ending on long files leaves one worker
running alone. A file missing from the table (a new one) counts by its markers: end-to-end ones first.

    .venv/bin/python -m tests.file_seconds junit.xml    # rewrite the table from a run's --junitxml
    .venv/bin/python -m tests.file_seconds --replay junit.xml 3    # when each of 3 workers would end, in xdist's
                                                                   # order by test count and longest file first
"""

from __future__ import annotations

import heapq
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")
# A file not in the table: what an average file of its tier took (bench/RESULTS.md, "The suite's time").
UNKNOWN = {"system": 120.0, "slow": 60.0, "fast": 5.0}


def expected_seconds(items) -> dict[str, float]:
    """Each collected file's expected seconds, by its path relative to the repository (a pytest node id's file)."""
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    seconds: dict[str, float] = {}
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        if name in seconds:
            continue
        tier = "system" if item.get_closest_marker("system") else "slow" if item.get_closest_marker("slow") else "fast"
        seconds[name] = float(table.get(name, UNKNOWN[tier]))
    return seconds


def tests_of(path: Path) -> dict[str, list[float]]:
    """Each file's tests' seconds (setup, call and teardown) in a pytest --junitxml report, in the report's order."""
    per_file: dict[str, list[float]] = defaultdict(list)
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "")
        file = next((f for f in _candidates(module) if Path(f).exists()), None)
        if file is not None:
            per_file[file].append(float(case.get("time", 0.0)))
    return per_file


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per file in a pytest --junitxml report, longest first."""
    per_file = {f: sum(times) for f, times in tests_of(path).items()}
    return {f: round(s, 1) for f, s in sorted(per_file.items(), key=lambda fs: -fs[1])}


def replay(files: dict[str, list[float]], order: list[str], workers: int) -> list[float]:
    """When each worker would end, giving whole files in ``order`` as xdist's loadfile does: two to each worker at
    the start, one more to a worker with 2 or fewer tests pending (xdist/scheduler/loadscope.py)."""
    pending: list[list[float]] = [[] for _ in range(workers)]
    queue, clock = list(order), [0.0] * workers
    for _ in range(2):
        for w in range(workers):
            if queue and len(pending[w]) <= 2:
                pending[w] += files[queue.pop(0)]
    ready = [(0.0, w) for w in range(workers)]
    while ready:
        now, w = heapq.heappop(ready)
        clock[w] = now
        if pending[w]:
            took = pending[w].pop(0)
            if queue and len(pending[w]) <= 2:
                pending[w] += files[queue.pop(0)]
            heapq.heappush(ready, (now + took, w))
    return [round(c) for c in clock]


def _candidates(classname: str) -> list[str]:
    """A junit classname is the module's dotted path, then any class names: tests.unit.test_x.TestY."""
    parts = classname.split(".")
    return [str(Path(*parts[:n]).with_suffix(".py")) for n in range(len(parts), 1, -1)]


if __name__ == "__main__":
    if sys.argv[1] == "--replay":
        files = tests_of(Path(sys.argv[2]))
        n = int(sys.argv[3]) if len(sys.argv) > 3 else 3
        print("by test count (xdist's reorder):", replay(files, sorted(files, key=lambda f: -len(files[f])), n))
        print("longest file first:", replay(files, sorted(files, key=lambda f: -sum(files[f])), n))
    else:
        TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
