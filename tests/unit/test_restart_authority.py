"""The one restart authority (deployments/recovery.py): its decision as a pure function of a run's state history, made
of real Prefect state objects, and the worker's choice not to report an exit twice (deployments/worker.py). The last
two tests propose restarts through the reconciler against the session's real Prefect server."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Completed, Crashed, Failed, Pending, Running, Scheduled

from deployments import recovery
from deployments.recovery import TRANSITIONS, death_of, decide
from deployments.worker import should_report_exit

T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
SETTLE = timedelta(seconds=recovery.GRACE_SECONDS)
LATER = T0 + timedelta(minutes=5)  # long after every state below: each Crashed has settled


def history(*states):
    """The states, one second apart, oldest first (as the reconciler sorts what Prefect returns)."""
    for i, state in enumerate(states):
        state.timestamp = T0 + timedelta(seconds=i)
    return list(states)


def test_a_settled_crash_is_restarted_with_a_transition_id_derived_from_its_crashed_state():
    states = history(Pending(), Running(), Crashed(message="Flow run process exited with non-zero status code -9"))

    decision = decide(states, LATER, alive_since_crash=False, settle=SETTLE)

    assert decision.restart
    assert decision.transition_id == uuid.uuid5(TRANSITIONS, str(states[-1].id))
    assert decide(states, LATER, False, SETTLE) == decision  # a repeat proposes the same transition: refused


@pytest.mark.parametrize(
    "last",
    [Completed(), Failed(message="max_restarts=3"), Cancelled(name="Superseded"), Scheduled(name="AwaitingRestart"),
     Scheduled(name="Preempted"), Running(), Pending(), Crashed(name="AttemptDied")],
    ids=lambda s: f"{s.type.value}-{s.name}",
)  # fmt: skip
def test_nothing_but_a_crashed_run_is_restarted_completed_included(last):
    states = history(Running(), Crashed(), Scheduled(name="AwaitingRestart"), Running(), last)

    decision = decide(states, LATER, alive_since_crash=False, settle=SETTLE)

    assert not decision.restart and decision.transition_id is None, decision


def test_a_crash_is_not_restarted_before_it_settled_nor_while_its_attempt_shows_life():
    states = history(Running(), Crashed())

    assert not decide(states, states[-1].timestamp + SETTLE / 2, alive_since_crash=False, settle=SETTLE).restart
    late_report = decide(states, LATER, alive_since_crash=True, settle=SETTLE)
    assert not late_report.restart and "late report" in late_report.why


def test_a_second_report_of_one_death_landing_on_the_restart_restarts_it_as_the_same_transition():
    """Prefect's worker reports an exit 20-40 s after the runner: on the restart's Scheduled (or Pending) state it
    replaces the restart. The run must run again, and the id is the first Crashed's: one death, one transition."""
    states = history(
        Running(), Crashed(message="runner"), Scheduled(name="AwaitingRestart"), Pending(), Crashed(message="worker")
    )

    decision = decide(states, LATER, alive_since_crash=False, settle=SETTLE)

    assert death_of(states) is states[1]
    assert decision.restart and decision.transition_id == uuid.uuid5(TRANSITIONS, str(states[1].id))


def test_a_new_attempt_that_died_is_a_new_death():
    states = history(Running(), Crashed(), Scheduled(name="AwaitingRestart"), Running(), Crashed())

    decision = decide(states, LATER, alive_since_crash=False, settle=SETTLE)

    assert decision.restart and decision.transition_id == uuid.uuid5(TRANSITIONS, str(states[-1].id))


@pytest.mark.parametrize(
    ("attempt", "run_count", "state", "report"),
    [
        (1, 1, StateType.RUNNING, True),  # the process died while its attempt ran: only the worker may know
        (1, 0, StateType.PENDING, True),  # it died before its engine started
        (1, 1, StateType.CRASHED, False),  # the runner recorded it already
        (1, 1, StateType.SCHEDULED, False),  # ... and the run was restarted
        (1, 2, StateType.RUNNING, False),  # the next attempt runs: a Crashed would be a lie about it
        (1, 1, StateType.COMPLETED, False),
    ],
)
def test_the_worker_reports_an_exit_only_while_the_run_is_in_that_attempt(attempt, run_count, state, report):
    assert should_report_exit(attempt, run_count, state) is report


# -- through the reconciler, on a real server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(prefect_harness):
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("restart-authority-train")
        yield client, client.create_deployment(flow_id=flow_id, name="training")


def _run_in(client, deployment_id, *states):
    run = client.create_flow_run_from_deployment(deployment_id)
    for state in states:
        client.set_flow_run_state(run.id, state, force=True)
    return client.read_flow_run(run.id)


@pytest.mark.slow
def test_a_completed_run_proposed_for_a_restart_through_the_reconciler_is_refused(api):
    """What a 15-minute-late Crashed event, or a second reconciler that read the run while it was Crashed, does."""
    client, training = api
    crashed = _run_in(client, training, Running(), Crashed())  # what a stale reader saw
    client.set_flow_run_state(crashed.id, Running(), force=True)
    client.set_flow_run_state(crashed.id, Completed(), force=True)

    assert not recovery._restart(client, crashed)
    assert not recovery._restart(client, client.read_flow_run(crashed.id))
    assert recovery.sweep(client, [training], recovery.Windows.of(60, T0, settle_seconds=0)) == []
    state = client.read_flow_run(crashed.id).state
    assert state.type == StateType.COMPLETED


@pytest.mark.slow
def test_two_reconcilers_at_once_restart_a_crash_once(api):
    client, training = api
    run = _run_in(client, training, Running(), Crashed())
    go, results = threading.Barrier(2), []

    def reconciler():
        with get_client(sync_client=True) as own:
            go.wait()
            results.append(recovery._restart(own, run))  # both read the same Crashed state

    threads = [threading.Thread(target=reconciler) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert sorted(results) == [False, True]
    names = [s.name for s in client.read_flow_run_states(run.id)]
    assert names.count("AwaitingRestart") == 1, names


@pytest.mark.slow
def test_a_deployment_run_fenced_out_by_another_run_of_its_name_ends_cancelled_superseded(api, monkeypatch):
    """Issue 44, item 6: the run fenced out used to end Crashed, which the restart automation rescheduled, and it took
    the run back (a ping-pong). It ends once, Cancelled ``Superseded``, which the reconciler never restarts."""
    from prefect import flow
    from prefect.runtime import flow_run

    from flows import restarts
    from training.preemption import Preempted, Stop

    monkeypatch.setattr(restarts, "is_deployment_run", lambda: True)
    seen = {}

    @flow(name="fenced-out")
    def fenced_out():
        seen["id"] = flow_run.id
        by = {"owner": "another-flow-run-of-this-name"}
        raise restarts.leave(Preempted(Stop("handover", "another run took it over", 0.0, by), "ep1-ba8-sa256", 8, None))

    with pytest.raises((Preempted, restarts.StoppedRun)):  # a bare flow: TrainFlow would hand the caller the stop
        fenced_out()

    client, _ = api
    states = sorted(client.read_flow_run_states(uuid.UUID(seen["id"])), key=lambda state: state.timestamp)
    assert (states[-1].type, states[-1].name) == (StateType.CANCELLED, "Superseded"), states[-1]
    assert not any(state.type == StateType.CRASHED for state in states)
    assert not decide(states, LATER.replace(year=2100), alive_since_crash=False, settle=SETTLE).restart
