"""What a run's start-up costs before its first unit (issue 46): the trust check reads no API, and the run's first log
line says where the start-up went, phase by phase."""

from __future__ import annotations

import logging
import time
import uuid

from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext, _deployment_id

from flows import restarts
from training.run import Run
from training.start import phases
from training.start.phases import Phases

OPENING = ["trust", "preflight", "store", "checks", "claim", "start"]  # Run.open's phases, in order


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


def test_the_run_s_first_line_says_where_its_start_up_went_phase_by_phase(make_config, caplog):
    config = make_config(max_duration="1ep")
    clock = Phases()
    time.sleep(0.05)
    clock.mark("restart checks")  # what the training flow marks before Run.open (flows/train.py)
    with caplog.at_level(logging.INFO, logger="training.run"), Run.open(config, phases=clock) as run:
        pass
    assert run.startup is clock
    assert list(clock.spans) == ["restart checks", *OPENING]
    assert clock.spans["restart checks"] >= 0.05
    assert all(seconds >= 0 for seconds in clock.spans.values())
    opened = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run r in ")]
    assert len(opened) == 1
    assert opened[0].endswith(clock.line())
    assert f"start-up {clock.total:.2f} s (restart checks {clock.spans['restart checks']:.2f} s, trust " in opened[0]
    assert all(f" {name} " in clock.line() for name in OPENING)

    again = Run.open(config)  # without a clock of the caller's: its own, from Run.open's start
    again.close()
    assert list(again.startup.spans) == OPENING


def test_a_warm_runner_s_hand_over_starts_the_clock_once():
    clock = phases.handed_over()
    time.sleep(0.05)
    clock.mark("reset")
    started = phases.starting()  # the flow body begins: the span since the reset is Prefect's flow run
    assert started is clock
    assert list(started.spans) == ["reset", "flow run"]
    assert started.spans["reset"] >= 0.05
    assert list(phases.starting().spans) == []  # a hand-over counts for the one run that follows it


def test_the_sweep_bench_reads_each_segment_s_start_up_phases_from_the_runs_first_lines():
    from bench.sweep_vs_ray import startup_phases

    lines = []
    for reset, flow_run in [(0.0, 0.12), (0.4, 0.1), (0.2, 0.14)]:
        clock = Phases()
        clock.spans.update({"reset": reset, "flow run": flow_run, "claim name": 0.01})
        lines.append(f"12:00:00.000 | INFO | training.run - run t000 in /runs/t000: no checkpoint; training to 1ep; "
                     f"{clock.line()}")  # fmt: skip
    assert startup_phases("\n".join(lines)) == {"reset": 0.2, "flow run": 0.12, "claim name": 0.01}
    assert startup_phases("Ray's side prints no such line") == {}
