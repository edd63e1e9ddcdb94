"""``python -m tests.run_lifecycle <flags>``: a run driven to its end without Prefect (tests/lifecycle.py), in a process
of its own, for tests that kill a real process and relaunch the same command. Flags are the train flow's; the
result is printed as one JSON line."""

from __future__ import annotations

import logging
import sys

from tests.lifecycle import train_to_end
from training.config import load_config


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    result = train_to_end(load_config(argv))
    print(result.model_dump_json(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
