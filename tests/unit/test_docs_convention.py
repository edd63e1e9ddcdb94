"""One command convention in every page: a shell block calls the project's interpreter by its path.

README.md and docs/running.md write `.venv/bin/python -m flows.train`, which works in a fresh shell; a page that wrote
a bare `python -m flows.train` failed there with "No module named 'fsspec'" (or ran another Python). This reads every
page's shell blocks without running them (tests/integration/test_docs.py runs them, and refuses the same).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import ROOT, Block, blocks, doc_pages


def test_no_page_has_a_bare_python_or_pip_in_a_shell_block():
    bare = [line for page in doc_pages() for block in blocks(page)[0] for line in block.bare_commands()]
    assert not bare, "\n".join(bare)


def _block(text: str, lang: str = "bash") -> Block:
    return Block(ROOT / "docs" / "page.md", 10, lang, text, None)


@pytest.mark.parametrize(
    "line",
    [
        "python -m flows.train --run_name x",
        "pip install mlflow",
        "cd runs && python3 -m checkpointing ls runs/x",
        "TRAIN_RUN_NAME=x python -m flows.train",
        "export S=$(python -c 'print(1)')",
        "python - <<'PY'",
        "pip3 install -e .",
    ],
)
def test_a_bare_python_or_pip_is_named_with_its_line_and_the_fix(line: str):
    (problem,) = _block(f"set -x\n{line}\n").bare_commands()
    assert problem.startswith("docs/page.md:12: bare `")  # the fence is line 10, the command its second line
    assert repr(line) in problem and "write `.venv/bin/p" in problem


@pytest.mark.parametrize(
    "line",
    [
        ".venv/bin/python -m flows.train --run_name x",
        "\"$repo/.venv/bin/python\" - <<'PY'",
        ".venv/bin/pip install mlflow",
        "make demo   # runs python -m flows.train for you",
        "echo $python",
        "ls runs/python-tests",
    ],
)
def test_the_convention_and_comments_pass(line: str):
    assert _block(f"{line}\n").bare_commands() == []


def test_a_console_block_is_read_at_its_prompts_only():
    block = _block(
        "$ .venv/bin/python -m flows.train --help\nusage: python -m flows.train [-h]\n$ pip list\n", "console"
    )
    (problem,) = block.bare_commands()
    assert problem.startswith("docs/page.md:13: bare `pip`")
    assert _block("python -m flows.train\n", "python").bare_commands() == []  # a Python block: not a command


def test_the_pages_that_set_the_convention_follow_it():
    """README.md and docs/running.md are what the other pages follow: each has a `.venv/bin/python -m` block."""
    for page in (ROOT / "README.md", ROOT / "docs" / "running.md"):
        scripts = [b.script for b in blocks(Path(page))[0] if b.is_shell]
        assert any(".venv/bin/python -m " in s for s in scripts), page
