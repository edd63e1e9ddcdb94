"""What a run's start-up costs before its first unit (issue 46): the trust check reads no API, and the run's first log
line says where the start-up went, phase by phase."""

from __future__ import annotations

import uuid

from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext, _deployment_id

from flows import restarts


class _NoApi:
    """Stands for prefect.runtime.deployment: reading ``id`` is the API call the flow body must not make."""

    reads = 0

    @property
    def id(self) -> str | None:
        type(self).reads += 1
        return "read-from-the-api"


def _in_flow_run(deployment_id: uuid.UUID | None) -> FlowRunContext:
    run = FlowRun(flow_id=uuid.uuid4(), deployment_id=deployment_id)
    return FlowRunContext.model_construct(flow_run=run)


def test_a_flow_run_says_whether_a_deployment_made_it_without_asking_the_api(monkeypatch):
    monkeypatch.setattr(restarts, "deployment", _NoApi())
    _NoApi.reads = 0
    with _in_flow_run(None):
        assert restarts.is_deployment_run() is False
        assert restarts.parameters_untrusted() is False
    with _in_flow_run(uuid.uuid4()):
        assert restarts.is_deployment_run() is True
    token = _deployment_id.set(uuid.uuid4())  # what Prefect's engine sets in a deployment run, for its subflows
    try:
        with _in_flow_run(None):  # a subflow (retrain's train) of a deployment run: its parameters are untrusted
            assert restarts.is_deployment_run() is True
    finally:
        _deployment_id.reset(token)
    assert _NoApi.reads == 0
    assert restarts.is_deployment_run() is True  # outside a flow run: prefect.runtime.deployment decides, as before
    assert _NoApi.reads == 1
