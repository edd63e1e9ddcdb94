"""``python -m tests.kill_at_folder <folder> <flags>``: ``python -m tests.run_lifecycle <flags>`` that SIGKILLs itself
the moment ``<folder>`` exists, as a machine dying mid-write would. An audit hook sees the ``os.mkdir`` of a folder of
that name (in any thread), and the first audited operation after it that finds the folder there is the process's
last: no poll from outside could catch the few milliseconds between a small checkpoint's folder and its manifest."""

from __future__ import annotations

import os
import signal
import sys


def kill_when_made(folder: str) -> None:
    name, seen, inside = os.path.basename(folder.rstrip("/")), [], []

    def hook(event: str, args: tuple) -> None:
        if inside:  # looking for the folder is audited too
            return
        inside.append(True)
        try:
            if seen and os.path.isdir(folder):
                os.kill(os.getpid(), signal.SIGKILL)
            if event == "os.mkdir" and args and os.path.basename(str(args[0]).rstrip("/")) == name:
                seen.append(True)
        finally:
            inside.pop()

    sys.addaudithook(hook)


if __name__ == "__main__":
    kill_when_made(sys.argv[1])
    from tests.run_lifecycle import main

    main(sys.argv[2:])
