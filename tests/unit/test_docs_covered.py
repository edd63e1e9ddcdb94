"""A doc block marked ``covered (file::test)`` is not run by the doc test (tests/integration/test_docs.py) because the
named integration test runs it already (issue 47): the marker must name a test that exists, or the block would be
run by nothing."""

from __future__ import annotations

from pathlib import Path

from tests.docs_blocks import blocks

BLOCK = "```bash\n.venv/bin/python -m flows.train --nproc_per_node 2\n```\n"
REAL = "tests/integration/test_distributed.py::test_two_gloo_processes_complete_the_run_with_the_expected_counters"


def page(tmp_path: Path, marker: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(f"# A page\n\n<!-- doc-test: {marker} -->\n{BLOCK}")
    return path


def test_a_covered_marker_naming_a_real_test_is_no_problem_and_is_the_blocks_marker(tmp_path):
    found, problems = blocks(page(tmp_path, f"covered ({REAL})"))
    assert problems == []
    assert found[0].marker == f"covered ({REAL})"


def test_a_covered_marker_naming_a_test_that_does_not_exist_is_a_problem(tmp_path):
    _, problems = blocks(page(tmp_path, "covered (tests/integration/test_distributed.py::test_nothing)"))
    assert problems == [
        "page.md:4: tests/integration/test_distributed.py::test_nothing does not exist, yet the marker says it runs "
        "this block"
    ]


def test_a_covered_marker_naming_no_test_is_a_problem(tmp_path):
    _, problems = blocks(page(tmp_path, "covered (by the distributed tests)"))
    assert problems == ["page.md:4: a covered marker names no test: write covered (tests/....py::test_name)"]
