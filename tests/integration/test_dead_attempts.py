"""A restarted attempt ends the task runs its flow run's dead attempts left unfinished, and only those.

On the session's Prefect server, a flow run goes through what a SIGKILL and the reconciler's restart do to it
(Running, Crashed, AwaitingRestart, Running again, run_count 2), with task runs in every state an attempt leaves and a
subflow (as retrain's train): ``flows.restarts.end_dead_attempts`` must end the first attempt's Running and Pending task
runs, the subflow its killed task run started and that subflow's task run Crashed "AttemptDied", and leave the finished
one and the second attempt's own running one alone.
(tests/integration/test_deployments.py checks the same after a real SIGKILL under a real worker.)
"""

from __future__ import annotations

from uuid import UUID

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.states import Completed, Crashed, Pending, Running, Scheduled

from flows.restarts import ATTEMPT_DIED, end_dead_attempts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


@flow(name="dead-attempts")
def a_flow() -> None:
    """Only its name and id are used: its runs are driven through the API."""


@task(name="a-unit")
def a_unit() -> None:
    """Only its name is used."""


def move(client, run_id: UUID, *states) -> None:
    for state in states:
        client.set_flow_run_state(run_id, state, force=True)


def test_only_the_task_runs_a_dead_attempt_left_unfinished_end_crashed_attempt_died(monkeypatch):
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(a_flow, state=Pending())
        move(client, run.id, Running())  # attempt 1
        done = client.create_task_run(a_unit, run.id, "done", state=Pending())
        client.set_task_run_state(done.id, Running())
        client.set_task_run_state(done.id, Completed())
        killed = client.create_task_run(a_unit, run.id, "killed", state=Pending())
        client.set_task_run_state(killed.id, Running())  # the process is SIGKILLed here ...
        never_started = client.create_task_run(a_unit, run.id, "never-started", state=Pending())
        subflow = client.create_flow_run(a_flow, parent_task_run_id=killed.id, state=Running())  # retrain's train
        in_subflow = client.create_task_run(a_unit, subflow.id, "in-subflow", state=Pending())
        client.set_task_run_state(in_subflow.id, Running())
        # ... the worker reports the death, the reconciler reschedules the run, a worker runs it again: attempt 2
        move(client, run.id, Crashed(), Scheduled(name="AwaitingRestart"), Pending(), Running())
        assert client.read_flow_run(run.id).run_count == 2
        own = client.create_task_run(a_unit, run.id, "own", state=Pending())
        client.set_task_run_state(own.id, Running())
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(run.id))  # what a worker gives the flow-run process

        ended = end_dead_attempts()

        states = {
            t.dynamic_key: t.state
            for t in (client.read_task_run(x.id) for x in (done, killed, never_started, own, in_subflow))
        }
        states["subflow"] = client.read_flow_run(subflow.id).state
    assert ended == 4
    assert {key: (s.type.value, s.name) for key, s in states.items()} == {
        "done": ("COMPLETED", "Completed"),
        "killed": ("CRASHED", ATTEMPT_DIED),
        "never-started": ("CRASHED", ATTEMPT_DIED),
        "own": ("RUNNING", "Running"),
        "subflow": ("CRASHED", ATTEMPT_DIED),
        "in-subflow": ("CRASHED", ATTEMPT_DIED),
    }
    assert states["never-started"].message.startswith("an earlier attempt of this flow run died before ending it")
    assert all("attempt 2 took the run over" in states[key].message for key in ("killed", "subflow", "in-subflow"))
