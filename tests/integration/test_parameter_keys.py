"""A run's parameters cannot reach pydantic-settings: through a real server and process worker on a deployment whose
schema enforcement is off, through ``serve()`` without it, and through a Python call with a raw dict.

Each attack names an endpoint of a small HTTP listener on a loopback port as ``storage_options`` (in another case,
or as hidden flags through pydantic-settings' ``_cli_parse_args``). The flow-run process holds AWS credentials, as
a worker does; before the fix it signed S3 requests to that endpoint. Now each run ends Failed with one line naming
the key, and the listener never sees a connection. The API's own schema check would refuse these keys: these
paths do not have it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound, ParameterTypeError
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments import stack as stacks
from flows.train import train
from tests.conftest import ROOT
from tests.integration.test_deployments import client, start_run, wait_for, wait_for_state

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(900)]

WORKER_AWS = {"AWS_ACCESS_KEY_ID": "AKIAWORKERSOWNKEY", "AWS_SECRET_ACCESS_KEY": "worker-secret", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
BASE = {"recipe": "synthetic", "recipe_args": {"num_samples": 64}, "global_batch_size": 32, "max_duration": "1ep",
        "save_folder": "s3://creators-bucket/runs", "unit_retries": 0, "store_retry_attempts": 1}  # fmt: skip
PRIVATE = "is not a field: keys starting with '_' are pydantic-settings' own options, never read here"


class Listener:
    """An HTTP endpoint on a free loopback port that records every connection and request, and answers 403."""

    def __init__(self):
        self.seen: list[str] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def answer(self):
                seen.append(f"{self.command} {self.path} {self.headers.get('Authorization', '')[:60]}")
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = answer

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            def verify_request(self, request, client_address):
                seen.append(f"connection from {client_address[0]}")
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    running = Listener()
    yield running
    running.close()


def attacks(endpoint: str) -> dict[str, tuple[dict, str]]:
    """name -> (the run's config parameter, the line its refusal must hold)."""
    options = {"client_kwargs": {"endpoint_url": endpoint}}
    return {
        "case variant": ({**BASE, "run_name": "v", "Storage_Options": options},
                         "TrainConfig: key 'Storage_Options' is not a field: field names are matched exactly, write "
                         "'storage_options'"),
        "hidden flags": ({**BASE, "run_name": "f", "_cli_parse_args": ["--storage_options", json.dumps(options)]},
                         f"TrainConfig: key '_cli_parse_args' {PRIVATE}"),
        "env prefix": ({**BASE, "run_name": "p", "_env_prefix": ""}, f"TrainConfig: key '_env_prefix' {PRIVATE}"),
        "exact key": ({**BASE, "run_name": "e", "storage_options": options},
                      "storage_options cannot be set through a flow-run parameter"),
    }  # fmt: skip


def refused_on(stack, deployment: str, listener: Listener, folder=None, only: tuple[str, ...] = ()) -> None:
    """Starts every attack on ``deployment`` (or those named in ``only``); each run ends Failed with its line, and
    nothing reached the listener. Given a ``folder``, a run with the same settings and no attack completes there:
    the door is open, only the keys are refused."""
    cases = {name: case for name, case in attacks(listener.url).items() if not only or name in only}
    runs = {name: start_run(stack, deployment, {"config": config}) for name, (config, _) in cases.items()}
    plain = folder and start_run(
        stack, deployment, {"config": {**BASE, "run_name": "plain", "save_folder": str(folder)}}
    )
    for name, run_id in runs.items():
        message = wait_for_state(stack, run_id, StateType.FAILED).state.message
        assert any(cases[name][1] in line for line in message.splitlines()), f"{name}: {message}"
    if plain:
        wait_for_state(stack, plain, StateType.COMPLETED)
    assert listener.seen == [], f"the flow-run process contacted the run's endpoint: {listener.seen[:5]}"


def test_a_deployment_without_schema_enforcement_refuses_them_on_a_real_worker(prefect_stack, listener, tmp_path):
    yaml_file = tmp_path / "no-schema.yaml"  # JSON is YAML: a test-only deployment, never in deployments/
    yaml_file.write_text(json.dumps({
        "name": "parameter-keys-test", "prefect-version": "3.8.8", "build": None, "push": None,
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $TRAINING_PROJECT_DIR }}"}}],
        "deployments": [{
            "name": "no-schema-check", "entrypoint": "flows/train.py:train", "enforce_parameter_schema": False,
            "parameters": {"config": {}},
            "work_pool": {"name": stacks.POOL, "job_variables": {"env": WORKER_AWS}},
        }],
    }))  # fmt: skip
    prefect_stack.stack.prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(yaml_file), timeout=300)
    with client(prefect_stack) as c:
        assert c.read_deployment_by_name("train/no-schema-check").enforce_parameter_schema is False

    refused_on(prefect_stack, "train/no-schema-check", listener, tmp_path / "runs")


def test_a_flow_served_without_schema_enforcement_refuses_them(prefect_stack, listener, tmp_path):
    """One attack through serve(), not all four and the plain run again (issue 47): the refusing code is the same
    on both paths. The worker's flow-run process is Prefect's engine command (prefect.engine, or its workspace
    bootstrap into prefect.flow_engine), which reads the run from the API and calls
    ``prefect.flow_engine.run_flow(flow, flow_run=...)``; ``serve()`` runs each flow run in
    ``run_flow_in_subprocess(flow, flow_run=...)``, which calls the same ``run_flow`` in a spawned process.
    ``run_flow`` validates the run's parameters with ``Flow.validate_parameters`` (TrainConfig's key check,
    training/config/text.py, refuses the case variant, the hidden flags and the env prefix; tests/unit/
    test_config_keys.py and the Python-call test below reach it directly), then runs the flow body, whose
    ``refuse_storage_options_from_parameters`` (the exact key) reads the parameters from the FlowRunContext that
    ``run_flow`` sets on both paths. What differs here is how the process starts and where its AWS keys come from
    (serve()'s own environment, not the job variables): the hidden flags, the attack that reached storage_options
    through pydantic-settings' own command line, show a served process refuses with the keys in hand and the
    listener hears nothing. The worker test above sends all four and the plain run that completes."""
    serve = "from flows.train import train; train.serve(name='served-no-schema', enforce_parameter_schema=False)"
    proc = subprocess.Popen(
        [sys.executable, "-c", serve],
        cwd=ROOT,
        env=prefect_stack.stack.env(**WORKER_AWS),
        stdout=(tmp_path / "serve.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def served():
            with client(prefect_stack) as c:
                try:
                    return c.read_deployment_by_name("train/served-no-schema")
                except ObjectNotFound:
                    return None

        assert wait_for(served, 120, "serve() to register its deployment").enforce_parameter_schema is False
        refused_on(prefect_stack, "train/served-no-schema", listener, only=("hidden flags",))
    finally:
        stacks.stop(proc)


@pytest.mark.parametrize("case", ["case variant", "hidden flags", "env prefix"])
def test_a_python_call_with_a_raw_dict_refuses_them(case, prefect_stack, listener, monkeypatch):
    for key, value in WORKER_AWS.items():
        monkeypatch.setenv(key, value)
    config, line = attacks(listener.url)[case]
    with (
        temporary_settings(updates={PREFECT_API_URL: prefect_stack.api_url}),
        pytest.raises(ParameterTypeError) as info,
    ):
        train(config)
    assert f"config: Value error, {line}" in str(info.value)
    assert listener.seen == []
