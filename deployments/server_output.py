"""The Prefect server's output in `make stack` / `make server`: all of it in a log file, the terminal spared its
SQLite lock tracebacks.

On SQLite, a server whose services and API write at once logs ``sqlite3.OperationalError: database is locked``
with a 40-line traceback each time (its services retry on their next loop), which buried the stack's terminal.
Every line still goes to the log file; at the terminal, an error record (a log line at ERROR or CRITICAL, or a bare
traceback, with what follows it until the next record) that is a lock error becomes one line, said again at the
10th, 100th, ... occurrence; any other error record is shown whole, as before.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import threading
from collections.abc import Callable
from typing import IO

LOCKED = "database is locked"
# The start of a log record: Prefect's format ("12:00:00.123 | ERROR   | name - ...") or uvicorn's ("ERROR:    ...")
RECORD = re.compile(r"^(\d\d:\d\d:\d\d\.\d+ \| (?P<level>[A-Z]+)\s*\||(?P<uvicorn>[A-Z]+):\s)")
ERRORS = ("ERROR", "CRITICAL")
IDLE = 1.0  # seconds without output after which an error record being read has ended


class ServerOutput:
    """Takes the server's output line by line (``feed``), writes each to ``log`` and the rest to ``show``."""

    def __init__(self, log: IO[str], show: Callable[[str], None]):
        self.log = log
        self.show = show
        self.locked = 0  # lock errors so far
        self._record: list[str] = []  # an error record being read, shown or summed up once it ends

    def feed(self, line: str) -> None:
        self.log.write(line)
        self.log.flush()
        starts = RECORD.match(line)
        if starts or not self._record:
            self.flush()
        level = (starts["level"] or starts["uvicorn"]) if starts else None
        if level in ERRORS or (not starts and line.startswith("Traceback (most recent call last)")):
            self._record.append(line)
        elif self._record:
            self._record.append(line)  # the traceback and message of the error record being read
        else:
            self.show(line)

    def flush(self) -> None:
        """Ends the error record being read: one line for a lock error, else the record as written."""
        record, self._record = self._record, []
        if not record:
            return
        if any(LOCKED in line for line in record):
            self.locked += 1
            if _power_of_ten(self.locked):
                self.show(
                    f"prefect server: SQLite was busy ({LOCKED!r}, {self.locked} time(s) so far); the server's "
                    f"services retry; tracebacks in {self.log.name} (make stack DB=postgres has no such lock)\n"
                )
            return
        for line in record:
            self.show(line)


def relay(stream: IO[bytes], output: ServerOutput) -> threading.Thread:
    """A daemon thread that feeds ``stream`` (the server's stdout and stderr) to ``output`` line by line until it
    closes, ending an error record once the server has said nothing for IDLE seconds."""

    def run() -> None:
        fd, pending = stream.fileno(), b""
        while True:
            if not select.select([fd], [], [], IDLE)[0]:
                output.flush()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                _feed(output, line.decode(errors="replace") + "\n")
        if pending:
            _feed(output, pending.decode(errors="replace") + "\n")
        output.flush()

    thread = threading.Thread(target=run, name="prefect-server-output", daemon=True)
    thread.start()
    return thread


def _feed(output: ServerOutput, line: str) -> None:
    """Never stops reading: a server whose pipe fills up blocks (a full disk under the log shows the line as is)."""
    try:
        output.feed(line)
    except Exception:
        with contextlib.suppress(Exception):
            output.show(line)


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1
