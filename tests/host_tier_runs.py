"""``python -m tests.host_tier_runs <log folder> <count> <flags>``: ``count`` runs of the Prefect-free lifecycle
(tests/lifecycle.py), run ``i`` named ``k<i>`` with its output in ``<log folder>/k<i>.log``, each in a process of its
own forked from this one once the imports are done (3 s once, not per run). Prints each child's pid, one a line, and
waits for them: tests SIGKILL them mid-run (tests/integration/test_host_tier_gc.py)."""

from __future__ import annotations

import logging
import os
import sys

from tests.lifecycle import train_to_end
from training.config import load_config


def _child(folder: str, i: int, flags: list[str]) -> None:
    code = 1
    try:
        fd = os.open(os.path.join(folder, f"k{i}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout, force=True)
        train_to_end(load_config([*flags, "--run_name", f"k{i}"]))
        code = 0
    finally:
        sys.stdout.flush()
        os._exit(code)


def main(argv: list[str]) -> None:
    folder, count, flags = argv[0], int(argv[1]), argv[2:]
    pids = []
    for i in range(count):
        pid = os.fork()
        if pid == 0:
            _child(folder, i, flags)
        pids.append(pid)
        print(pid, flush=True)
    for pid in pids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1:])
