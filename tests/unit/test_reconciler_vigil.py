"""The reconciler counts a run's silence only from when the server stores events again (deployments/recovery.py,
Vigil; issue 44's fault matrix). Against the session's real Prefect test server on SQLite: a second process's write
transaction on its database (what made the server store nothing for 2 minutes while it answered reads, and a healthy
run be marked Crashed) moves ``since``; while the server stores events, ``since`` stays the reconciler's start."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

from deployments.recovery import Vigil

pytestmark = pytest.mark.slow  # ~50 s of waiting for the server's event batches

STALL = 8.0  # the server stores events in batches, every few seconds (Prefect's event persister)
HOLD = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def passes(vigil: Vigil, client, seconds: float) -> list:
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(vigil.check(client))
        EventsWorker.drain_all(timeout=1)
        time.sleep(0.3)
    return seen


def test_silence_counts_from_after_the_server_stored_no_event(prefect_harness):
    db = PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1]
    sqlite3.connect(db).close()  # the harness's database file exists
    with get_client(sync_client=True) as client:
        vigil = Vigil(stall_seconds=STALL)
        start = vigil.since

        assert set(passes(vigil, client, STALL * 1.5)) == {start}  # events stored: silence counts from the start

        holder = subprocess.Popen([sys.executable, "-c", HOLD, db, str(STALL * 2.5)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        held_at = time.time()
        during = passes(vigil, client, STALL * 2.5)
        assert holder.wait(timeout=60) == 0
        assert during[-1] > start and during[-1].timestamp() > held_at + STALL  # it moved while nothing was stored

        after = passes(vigil, client, STALL * 2)
        assert after[-1] == after[len(after) // 2]  # stored again: it stays put
