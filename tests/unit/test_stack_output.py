"""`make stack`'s terminal (deployments/stack.py, deployments/server_output.py): the banner names what `prefect deploy`
deployed, and the Prefect server's SQLite lock tracebacks become one line there while its log keeps every line and
any other error is shown whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from deployments import stack as stacks
from deployments.server_output import ServerOutput, relay

LOCK_TRACEBACK = """\
12:00:01.100 | ERROR   | prefect.server.services.task_run_recorder - Error recording task run
Traceback (most recent call last):
  File "/x/sqlalchemy/engine/base.py", line 1967, in _exec_single_context
    self.dialect.do_execute(
sqlite3.OperationalError: database is locked

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/prefect/server/services/task_run_recorder.py", line 60, in record
    await session.commit()
sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) database is locked
[SQL: INSERT INTO task_run ...]
(Background on this error at: https://sqlalche.me/e/20/e3q8)
"""
OTHER_ERROR = """\
12:00:02.000 | ERROR   | uvicorn.error - Exception in ASGI application
Traceback (most recent call last):
  File "/x/app.py", line 1, in handle
ValueError: a real failure
"""


def test_lock_tracebacks_become_one_line_and_the_log_keeps_everything(tmp_path: Path):
    shown: list[str] = []
    with open(tmp_path / "server.log", "a") as log:
        output = ServerOutput(log, shown.append)
        text = "12:00:00.000 | INFO    | prefect.server - started\n" + LOCK_TRACEBACK * 12 + OTHER_ERROR
        text += "12:00:03.000 | INFO    | prefect.server - still serving\n"
        for line in text.splitlines(keepends=True):
            output.feed(line)
        output.flush()
    assert (tmp_path / "server.log").read_text() == text
    terminal = "".join(shown)
    assert "Traceback" in terminal and "ValueError: a real failure" in terminal  # another error, whole
    assert terminal.count("Traceback") == 1 and LOCK_TRACEBACK.splitlines()[0] not in terminal
    locked = [line for line in shown if "SQLite was busy" in line]
    assert len(locked) == 2 and "1 time(s) so far" in locked[0] and "10 time(s) so far" in locked[1], locked
    assert str(tmp_path / "server.log") in locked[0]
    assert terminal.startswith("12:00:00.000 | INFO") and terminal.endswith("still serving\n")


def test_the_relay_reads_a_real_pipe_and_ends_a_record_when_the_server_goes_quiet(tmp_path: Path):
    """An error record is known to be whole at the next record, or after a second of silence (the last one here)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.stdout.write({(LOCK_TRACEBACK + OTHER_ERROR)!r})
        sys.stdout.flush()
        time.sleep(2.5)
        print("12:00:04.000 | INFO    | prefect.server - bye")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    shown: list[str] = []
    with open(tmp_path / "server.log", "a") as log:
        assert proc.stdout is not None
        thread = relay(proc.stdout, ServerOutput(log, shown.append))
        assert proc.wait(timeout=60) == 0
        thread.join(timeout=60)
    before_bye = "".join(shown).split("bye")[0]
    assert "ValueError: a real failure" in before_bye  # shown during the silence, not held until the next record
    assert sum("SQLite was busy" in line for line in shown) == 1
    assert "database is locked" in (tmp_path / "server.log").read_text()


def test_the_banner_names_every_deployment_of_prefect_yaml():
    """`prefect deploy --all`'s own lines are what the banner lists (it once left out sweep/default)."""
    entries = yaml.safe_load(stacks.PREFECT_YAML.read_text())["deployments"]
    flows = {"train": "train", "rank_node": "rank-node", "retrain": "retrain", "sweep": "sweep"}  # @flow(name=...)
    expected = [f"{flows[e['entrypoint'].rsplit(':', 1)[1]]}/{e['name']}" for e in entries]
    assert "sweep/default" in expected
    output = "".join(
        f"Deployment '{name}' successfully created with id\n'0b5e-{i}'.\n\nTo execute flow runs ...\n"
        for i, name in enumerate(expected)
    )
    assert stacks.deployed(output) == expected
