"""The front page stays a front page, and no relative link of README.md or docs/*.md leads nowhere.

Cheap (reads files only); tests/integration/test_docs.py runs the pages' shell blocks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_blocks import FENCE, MARKER, ROOT, blocks, doc_pages

README_MAX_LINES = 260

LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
MARKER_KINDS = re.compile(r"^(skip \(.+\)|background \(waits for \".+\"\)|exits \d+|covered \(tests/.+::test_\w+\))$")


def _prose(path: Path) -> str:
    """The page without its fenced blocks and code spans (a link-like text there is code, not a link)."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line) or (inside and line.rstrip() == "```"):
            inside = not inside
            continue
        if not inside:
            out.append(CODE_SPAN.sub("", line))
    return "\n".join(out)


def _anchors(path: Path) -> set[str]:
    """GitHub's ids for the headings of ``path``: lower case, punctuation dropped, spaces as hyphens."""
    ids = set()
    for line in _prose(path).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def _links() -> list[tuple[Path, str]]:
    return [(page, m["target"]) for page in doc_pages() for m in LINK.finditer(_prose(page))]


def test_readme_is_a_front_page_of_at_most_260_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move details to a page under docs/"


@pytest.mark.parametrize(("page", "target"), _links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_points_to_a_file_that_exists(page: Path, target: str):
    if re.match(r"^[a-z]+:", target):  # https:, mailto:
        return
    path_part, _, anchor = target.partition("#")
    linked = (page.parent / path_part).resolve() if path_part else page
    assert linked.exists(), f"{page.relative_to(ROOT)} links {target!r}, which does not exist"
    if anchor and linked.suffix == ".md":
        assert anchor in _anchors(linked), f"{page.relative_to(ROOT)} links {target!r}: no such heading"


def test_every_doc_test_marker_is_well_formed_and_placed_right_before_a_fence():
    for page in doc_pages():
        found, problems = blocks(page)
        assert not problems, problems
        for block in found:
            if block.marker is None:
                continue
            assert block.is_shell, f"{block.where}: a doc-test marker on a {block.lang or 'plain'} block"
            assert MARKER_KINDS.match(block.marker), f"{block.where}: unknown marker {block.marker!r}"
        text = page.read_text()
        assert text.count("doc-test:") == sum(1 for line in text.splitlines() if MARKER.match(line.strip())), page
