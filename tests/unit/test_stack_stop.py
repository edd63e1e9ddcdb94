"""How the local stack (`make stack`, deployments/stack.py) ends its processes: the worker and the reconciler are
stopped together, not one after the other (each may take its time, and in turn they outlasted what a terminal or the
doc test waits for Ctrl-C), and a stack killed outright leaves none of its children behind (they run in sessions of
their own, so a SIGKILL of the stack's group never reached them: a server and a worker lived on)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from deployments import stack as stacks
from tests.conftest import ROOT
from tests.procs import alive

# A child that says when its SIGTERM came, takes a second to stop, and says when it ends.
SLOW_TO_STOP = textwrap.dedent(
    """
    import signal, sys, time
    out = sys.argv[1]
    def stopping(*_):
        open(out, "a").write(f"term {time.monotonic()}\\n")
        time.sleep(1.0)
        open(out, "a").write(f"exit {time.monotonic()}\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopping)
    open(out, "a").write("ready\\n")
    time.sleep(300)
    """
)


def wait_for(predicate, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_worker_and_the_reconciler_are_asked_to_stop_together(tmp_path):
    outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    procs = [stacks._spawn([sys.executable, "-c", SLOW_TO_STOP, str(out)], dict(os.environ), None) for out in outs]
    for out in outs:
        wait_for(lambda out=out: out.exists() and "ready" in out.read_text(), f"{out.name} ready")

    stacks.stop_together(procs)

    said = [dict(line.split() for line in out.read_text().splitlines()[1:]) for out in outs]
    assert all(p.returncode == 0 for p in procs)  # each stopped politely, none was SIGKILLed
    # the second got its SIGTERM while the first was still stopping: one after the other, it would come after
    assert float(said[1]["term"]) < float(said[0]["exit"]) and float(said[0]["term"]) < float(said[1]["exit"])


def test_a_stack_killed_outright_leaves_no_child_behind(tmp_path):
    out = tmp_path / "child.txt"
    stack = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys, time
            from deployments import stack
            child = stack._spawn([sys.executable, "-c", {SLOW_TO_STOP!r}, {str(out)!r}], dict(os.environ), None)
            print(child.pid, flush=True)
            time.sleep(300)
        """)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stack.stdout is not None
    child = int(stack.stdout.readline())
    wait_for(lambda: out.exists() and "ready" in out.read_text(), "the child ready")

    stack.kill()  # SIGKILL: no finally, no stop
    stack.wait()

    wait_for(lambda: not alive(child), "the stack's child outlived it")
    assert "term" in out.read_text()  # it was asked politely (SIGTERM), as the stack's own stop would
