"""How long each test file took in a full run (tests/file_seconds.json), for tests/conftest.py to collect the longest
first: `make test`'s xdist workers take whole files in collection order, and ending on long files leaves one worker
running alone. A file missing from the table (a new one) counts by its markers: end-to-end ones first.

    .venv/bin/python -m tests.file_seconds junit.xml    # rewrite the table from a run's --junitxml
"""

from __future__ import annotations

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


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per file (setup, call and teardown of each of its tests) in a pytest --junitxml report."""
    per_file: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "")
        file = next((f for f in _candidates(module) if Path(f).exists()), None)
        if file is not None:
            per_file[file] += float(case.get("time", 0.0))
    return {f: round(s, 1) for f, s in sorted(per_file.items(), key=lambda fs: -fs[1])}


def _candidates(classname: str) -> list[str]:
    """A junit classname is the module's dotted path, then any class names: tests.unit.test_x.TestY."""
    parts = classname.split(".")
    return [str(Path(*parts[:n]).with_suffix(".py")) for n in range(len(parts), 1, -1)]


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
