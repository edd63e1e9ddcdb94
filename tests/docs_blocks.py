"""The fenced blocks of the project's Markdown pages, and the doc-test marker written right before a fence.

Shared by tests/integration/test_docs.py (which runs every shell block), tests/unit/test_docs_links.py and
tests/unit/test_docs_convention.py (which read the pages without running anything). A marker is an HTML comment on the last non-blank line
before the fence, invisible on GitHub:

    <!-- doc-test: skip (why it cannot run unattended) -->
    <!-- doc-test: background (waits for "text it prints once it is ready") -->
    <!-- doc-test: exits 2 -->
    <!-- doc-test: covered (tests/integration/test_x.py::test_name) -->   run by that test already: the doc test
                                                                          does not run it again (issue 47); the
                                                                          named test must exist (a problem if not)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<body>.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
EXPECT = re.compile(r"^\s*# -> (?P<text>.+?)\s*$")
COVERED = re.compile(r"^covered \((?P<file>tests/[\w/]+\.py)::(?P<test>test_\w+)\)$")
# The one command convention of the pages: the project's interpreter by its path, `.venv/bin/python -m ...` and
# `.venv/bin/pip install ...`, which work without an activated venv (a bare `python -m flows.train` there fails
# with "No module named 'fsspec'", or runs another Python). A bare python/pip is a word of its own, not a path's end.
BARE_COMMAND = re.compile(r"(?<![\w./$-])(?P<cmd>python3?|pip3?)(?=\s|$)")
COMMENT = re.compile(r"(^|\s)#.*$")


def doc_pages() -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of the fence), its language, text and marker."""

    path: Path
    line: int
    lang: str
    text: str
    marker: str | None  # the marker's body ("skip (...)", "background (...)", "exits 2"), or None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGUAGES

    @property
    def script(self) -> str:
        """What a person types: the block as written; for ``console``, the lines after a ``$ `` prompt."""
        if self.lang != "console":
            return self.text
        return "\n".join(line[2:] for line in self.text.splitlines() if line.startswith("$ "))

    def bare_commands(self) -> list[str]:
        """What breaks the command convention: one line per bare ``python``/``pip`` in this shell block (comments
        aside), saying where and what to write instead; empty for a block that is not shell."""
        if not self.is_shell:
            return []
        found = []
        for i, line in enumerate(self.text.splitlines()):
            if self.lang == "console" and not line.startswith("$ "):
                continue  # a console block's output
            for m in BARE_COMMAND.finditer(COMMENT.sub("", line.removeprefix("$ "))):
                found.append(
                    f"{self.path.relative_to(ROOT)}:{self.line + 1 + i}: bare `{m['cmd']}` in {line.strip()!r}: "
                    f"write `.venv/bin/{m['cmd'].rstrip('3')}` (works without an activated venv, as in README.md "
                    f"and docs/running.md)"
                )
        return found

    @property
    def expected(self) -> list[str]:
        """Output the page promises: ``# -> text`` lines, and a ``console`` block's lines without a prompt."""
        found = [m["text"] for line in self.text.splitlines() if (m := EXPECT.match(line))]
        if self.lang == "console":
            found += [line.strip() for line in self.text.splitlines() if line.strip() and not line.startswith("$ ")]
        return found


def covered_problem(where: str, marker: str) -> str | None:
    """A ``covered (file::test)`` marker whose test does not exist (so the block would be run by nothing)."""
    m = COVERED.match(marker)
    if not m:
        return f"{where}: a covered marker names no test: write covered (tests/....py::test_name)"
    source = ROOT / m["file"]
    if not source.is_file() or not re.search(rf"^def {m['test']}\(", source.read_text(), re.MULTILINE):
        return f"{where}: {m['file']}::{m['test']} does not exist, yet the marker says it runs this block"
    return None


def blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``path``, and the problems found on the way (a marker that no fence follows, an
    unclosed fence)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str] | None = None  # a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line.strip())
        fence = FENCE.match(line)
        if marker:
            if pending:
                problems.append(f"{path.name}:{pending[0]}: marker not followed by a fence")
            pending = (i + 1, marker["body"])
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
            if end is None:
                problems.append(f"{path.name}:{i + 1}: fence never closed")
                break
            body = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(path, i + 1, fence["lang"], body, pending[1] if pending else None))
            if (
                pending
                and pending[1].startswith("covered")
                and (bad := covered_problem(f"{path.name}:{i + 1}", pending[1]))
            ):
                problems.append(bad)
            pending = None
            i = end
        elif line.strip() and pending:
            problems.append(f"{path.name}:{pending[0]}: marker not followed by a fence")
            pending = None
        i += 1
    if pending:
        problems.append(f"{path.name}:{pending[0]}: marker not followed by a fence")
    return found, problems
