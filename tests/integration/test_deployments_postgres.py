"""The deployment tests that a database can break, again on a stack whose server keeps its state in PostgreSQL.

test_deployments.py runs every deployment test on SQLite (the zero-set-up default of `make stack`). On SQLite a
write that collided with a state change was retried (in older versions, the restart automation's, which restarted a
crashed run again each time; deployments/automations.py): a crash -> restart is what a database can break, so the
killed flow-run test runs here too, with its assertions unchanged, on a PostgreSQL server started for this module:
one Crashed, one AwaitingRestart, run_count 2, never Failed, one new fence, the outcome waiter's Completed. The killed
nightly tick (the same crash and restart, of a run that a schedule named) ran here as well until issue 47; it adds a
schedule's name and a train subflow, which the database does not decide, and it runs on SQLite. The rest passed on
PostgreSQL as well (`make test-deployments DB=postgres`, docs/deployments-postgres.md), and would only repeat minutes
of training here. The last test proves the state really is in PostgreSQL and that its password reaches the server
alone.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from deployments import postgres
from tests.integration.conftest import processes_mentioning
from tests.integration.stack_client import client, start_run
from tests.integration.test_deployments import (  # noqa: F401 - collected here, on this module's stack
    test_killed_flow_run_process_is_restarted_as_the_same_run_and_resumes,
)
from tests.procs import environ

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(900)]

STACK_DATABASE = "postgres"  # tests/integration/conftest.py: this module's stack runs on PostgreSQL


async def _rows(pg: postgres.LocalPostgres, query: str) -> list:
    import asyncpg

    conn = await asyncpg.connect(host="127.0.0.1", port=pg.port, user=postgres.SUPERUSER,
                                 password=pg.password(), database=postgres.DATABASE)  # fmt: skip
    try:
        return await conn.fetch(query)
    finally:
        await conn.close()


def test_the_server_keeps_its_state_in_postgresql_and_its_password_to_itself(prefect_stack):
    pg = prefect_stack.postgres
    start_run(prefect_stack, "train/default", {"config": {}}, datetime(2100, 1, 1, tzinfo=UTC))  # never due
    with client(prefect_stack) as c:
        api_runs = {str(run.id) for run in c.read_flow_runs()}
        api_deployments = {d.name for d in c.read_deployments()}

    table_runs = {str(row["id"]) for row in asyncio.run(_rows(pg, "SELECT id FROM flow_run"))}
    table_deployments = {row["name"] for row in asyncio.run(_rows(pg, "SELECT name FROM deployment"))}
    assert api_runs and api_runs == table_runs  # the runs of this module, and nothing else
    assert api_deployments == table_deployments == {"default", "nightly"}
    assert not (prefect_stack.stack.home / "prefect.db").exists()  # no SQLite beside it

    password = pg.password().encode()
    assert b"***" in postgres.redact(pg.url).encode() and password not in postgres.redact(pg.url).encode()
    for log in prefect_stack.logs.iterdir():
        assert password not in log.read_bytes(), f"{log.name} shows the database password"
    assert password in environ(prefect_stack.server.pid)  # the server has it ...
    for pid in [prefect_stack.worker.pid, *processes_mentioning("prefect.engine")]:
        assert password not in environ(pid)  # ... the worker and any flow run do not
