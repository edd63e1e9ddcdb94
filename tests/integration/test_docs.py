"""Every shell block of README.md and docs/*.md runs as written, in order, and exits 0.

A page is run like a person would run it: in a fresh copy of the working tree (the files git tracks or would
track, with this checkout's .venv linked in and on PATH, as after `. .venv/bin/activate`), with a temporary HOME
and PREFECT_HOME, each block in bash with `set -e -o pipefail`. What a block exports and where it cd's carry
over to the page's next block, as in one terminal. A block passes when it exits 0 (or the status its marker
names) and its output holds every ``# -> text`` line it shows.

A block that cannot run unattended says so right before its fence (tests/docs_blocks.py):

    <!-- doc-test: skip (why) -->                          not run; the reason is the page's promise to readers
    <!-- doc-test: background (waits for "text") -->      a server the next blocks need (another terminal): started,
                                                           awaited until it prints ``text``, stopped with Ctrl-C's
                                                           SIGINT when the page is done; no process may survive it
    <!-- doc-test: exits 2 -->                             a command that is meant to fail, with that status
    <!-- doc-test: covered (tests/....py::test_name) -->   run by that test already (its name is checked): not run
                                                           again here, where each block costs a training (issue 47)

A block with no marker runs: a new block cannot rot unnoticed, and skipping one takes a written reason. Every shell
block, run or skipped, calls the project's interpreter by its path (``.venv/bin/python -m ...``, ``.venv/bin/pip``):
a page with a bare ``python``/``pip`` fails before anything runs (Block.bare_commands; the venv on PATH here would
hide what a reader without an activated venv meets).

One Prefect server is started for the module, and the pages' commands reach it through PREFECT_API_URL, as after
`make server` (otherwise each `python -m flows.train` would start a temporary one: 7-15 s apiece here). PREFECT_PORT
and LOCAL_S3_PORT are free ports, so a page's own `make stack` or `make s3` never meets another suite's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from deployments import stack as stacks
from flows.server import free_port
from tests.docs_blocks import ROOT, Block, blocks, doc_pages
from tests.procs import alive

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(1800)]

BLOCK_TIMEOUT = 600  # seconds: the longest block (make demo on a loaded 2-core machine) takes about a minute
READY_TIMEOUT = 300  # seconds a background block may take to print that it is ready
STOP_TIMEOUT = 60  # seconds a background block may take to stop after SIGINT
VENV = ROOT / ".venv"


def _pages_with_shell_blocks() -> list[Path]:
    return [page for page in doc_pages() if any(b.is_shell for b in blocks(page)[0])]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory) -> str:
    """A Prefect server for the module's commands (`make server`'s), stopped with the module."""
    stack = stacks.Stack(home=tmp_path_factory.mktemp("docs-prefect-server"), port=free_port())
    server = stacks.start_server(stack, stack.home / "server.log")
    try:
        stacks.wait_healthy(stack, server)
        yield stack.api_url
    finally:
        stacks.stop(server)


@pytest.mark.parametrize("page", _pages_with_shell_blocks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_block_of_the_page_runs_as_written(page: Path, tmp_path: Path, prefect_api: str):
    stamp = VENV / ".installed"
    if not stamp.exists() or any(
        stamp.stat().st_mtime < (ROOT / f).stat().st_mtime for f in ("pyproject.toml", "constraints.txt")
    ):
        pytest.fail("the .venv is not up to date: run `make install` (make test does)")
    found, problems = blocks(page)
    assert not problems, problems
    bare = [line for block in found for line in block.bare_commands()]  # tests/unit/test_docs_convention.py too
    assert not bare, "\n".join(bare)
    repo = _scratch_copy(tmp_path / "repo")
    terminal = _Terminal(repo, tmp_path, _environment(repo, tmp_path, prefect_api))
    try:
        for block in (b for b in found if b.is_shell):
            kind = (block.marker or "run").split(" ", 1)[0]
            if kind in ("skip", "covered"):
                continue
            if kind == "background":
                terminal.start_background(block)
                continue
            expected_status = int(block.marker.split()[1]) if kind == "exits" else 0
            terminal.run(block, expected_status)
    finally:
        survivors = terminal.stop_background()
    assert not survivors, f"{page.name}: processes left running by its background blocks: {survivors}"


def _scratch_copy(repo: Path) -> Path:
    """The working tree as git sees it (tracked and untracked-but-not-ignored files), mtimes kept so that make
    finds the linked .venv up to date, and the .venv itself linked, not copied."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a deleted but still tracked file is not in the working tree
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name, follow_symlinks=False)
    (repo / ".venv").symlink_to(VENV)
    return repo


def _environment(repo: Path, tmp_path: Path, prefect_api: str) -> dict[str, str]:
    """A user's shell with the venv activated and nothing of this test session's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "PREFECT_", "AWS_", "S3_", "PYTEST"))}
    (tmp_path / "home").mkdir()
    env.update(
        HOME=str(tmp_path / "home"),
        PATH=f"{repo / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(repo / ".venv"),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=prefect_api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_PORT=str(free_port()),
        LOCAL_S3_PORT=str(free_port()),
        OMP_NUM_THREADS="1",  # torch's one thread per core fights the servers for 2 cores (docs/deployments-postgres.md)
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    return env


class _Terminal:
    """One terminal's worth of state across a page's blocks, and the page's background processes."""

    def __init__(self, repo: Path, tmp_path: Path, env: dict[str, str]):
        self.env = env
        self.state = tmp_path / "terminal"
        self.state.mkdir()
        (self.state / "cwd").write_text(str(repo))
        self.background: list[tuple[Block, subprocess.Popen, Path]] = []
        self.count = 0

    def _script(self, block: Block, keep_state: bool) -> Path:
        self.count += 1
        carry = f'trap \'export -p > "{self.state}/exports"; pwd > "{self.state}/cwd"\' EXIT\n' if keep_state else ""
        script = self.state / f"block-{self.count}.sh"
        script.write_text(
            "set -e -o pipefail\n"
            f'[ -f "{self.state}/exports" ] && . "{self.state}/exports"\n'
            f'cd "$(cat "{self.state}/cwd")"\n' + carry + block.script
        )
        return script

    def run(self, block: Block, expected_status: int) -> None:
        started = time.monotonic()
        proc = subprocess.Popen(
            ["bash", str(self._script(block, keep_state=True))],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT} s:\n{block.text}\n{output[-6000:]}")
        print(f"{block.where}: exit {proc.returncode} in {time.monotonic() - started:.1f} s")
        assert proc.returncode == expected_status, (
            f"{block.where} exited {proc.returncode}, expected {expected_status}:\n{block.text}\n--- output ---\n{output[-6000:]}"
        )
        missing = [text for text in block.expected if text not in output]
        assert not missing, f"{block.where}: output lacks {missing}:\n{block.text}\n--- output ---\n{output[-6000:]}"

    def start_background(self, block: Block) -> None:
        ready = block.marker.split('waits for "', 1)[1].rsplit('"', 1)[0]
        log = self.state / f"background-{self.count + 1}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", str(self._script(block, keep_state=False))],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.background.append((block, proc, log))
        deadline = time.monotonic() + READY_TIMEOUT
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"{block.where}: never printed {ready!r}:\n{block.text}\n{log.read_text(errors='replace')[-6000:]}"
                )
            time.sleep(0.5)

    def stop_background(self) -> list[int]:
        """Ctrl-C to each background block, newest first; the pids of any process of theirs still alive after."""
        survivors = []
        for _, proc, _ in reversed(self.background):
            tree = [proc.pid, *stacks.descendants(proc.pid)]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            deadline = time.monotonic() + STOP_TIMEOUT
            while (left := [pid for pid in tree if alive(pid)]) and time.monotonic() < deadline:
                time.sleep(0.5)
            for pid in left:  # reported as a failure; killed so that it does not outlive the test
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            survivors += left
        return survivors
