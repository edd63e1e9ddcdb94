"""The heartbeat window lives on the server as a Prefect variable that ``python -m deployments.automations`` writes
and every reconciler reads (deployments/automations.py: no automation marks silence any more). Anyone with the API
can write a variable, so a reconciler checks it: a value that is not a number of seconds, or one that would mark
every healthy run Crashed, is said once and replaced by 3x the heartbeat frequency. Against the session's real
Prefect test server."""

from __future__ import annotations

import logging

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate

from deployments.automations import (
    HEARTBEAT_SETTING,
    WINDOW_VARIABLE,
    deployment_heartbeat,
    heartbeat_seconds,
    window_problem,
    window_seconds,
)


@pytest.fixture
def client(prefect_harness):
    with get_client(sync_client=True) as c:
        yield c
        if c.read_variable_by_name(WINDOW_VARIABLE) is not None:
            c.delete_variable_by_name(WINDOW_VARIABLE)


def put(client, value) -> None:
    if client.read_variable_by_name(WINDOW_VARIABLE) is None:
        client.create_variable(VariableCreate(name=WINDOW_VARIABLE, value=value))
    else:
        client.update_variable(VariableUpdate(name=WINDOW_VARIABLE, value=value))


def test_a_reconciler_uses_the_stored_window_and_refuses_a_bad_one(client, caplog):
    default = 3.0 * heartbeat_seconds([])
    assert window_seconds(client, []) == default  # nothing stored: 3x the heartbeat frequency

    put(client, default + 7.5)
    assert window_seconds(client, []) == default + 7.5

    frequency = heartbeat_seconds([])
    for bad in ["90", frequency, 1e12, True]:  # text, a window no longer than a heartbeat, a typo, a bool
        put(client, bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deployments.automations"):
            assert window_seconds(client, []) == default
        [line] = [r.getMessage() for r in caplog.records]
        assert WINDOW_VARIABLE in line and "--within" in line, line


def test_window_problem_names_why():
    assert window_problem(90.0, 30) is None
    assert "heartbeat frequency (30s)" in (window_problem(30, 30) or "")
    assert "not a number" in (window_problem(float("nan"), 30) or "")


def test_a_deployments_heartbeat_is_read_from_its_env_and_a_bad_one_counts_as_none(client, caplog):
    """What tells the reconciler to judge a run that has no heartbeat stored at all (deployments/recovery.py)."""
    flow_id = client.create_flow_from_name("liveness-window")

    def heartbeat_of(name: str, env: object):
        deployment_id = client.create_deployment(flow_id=flow_id, name=name, job_variables={"env": env})
        return deployment_heartbeat(client.read_deployment(deployment_id))

    assert heartbeat_of("beats", {HEARTBEAT_SETTING: "30"}) == 30
    assert heartbeat_of("silent", {}) is None
    for i, bad in enumerate(["thirty", "-5", "0", "1e3"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deployments.automations"):
            assert heartbeat_of(f"bad-{i}", {HEARTBEAT_SETTING: bad}) is None
        [line] = [r.getMessage() for r in caplog.records]
        assert HEARTBEAT_SETTING in line and repr(bad) in line, line
