"""Secrets never leave the process, against a real ``mlflow server``: a tracking URI with a password
(``http://trainer:<password>@host:port``, which MLflow's client sends as basic auth) and recipe arguments with
credentials nested below the first level. A run in a real process is SIGKILLed mid-unit and relaunched with the same
command (twice): the run folder, every line the processes printed, and what the server stored (params, tags, its
SQLite file) hold neither the password nor a nested credential, and each relaunch continues the same MLflow run."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_metrics import latest_step, launch, mlflow_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow
PASSWORD = "pw-7Yq2-never-leaves"
NESTED = {  # recipe arguments a person might pass; each value must stay out of MLflow
    "service": {"auth": {"api_key": "sk-nested-api-key-31"}, "region": "eu"},
    "deploy": [{"private_key": "-----BEGIN nested-private-key-31"}],
    "azure": {"connection_string": "AccountName=a;AccountKey=bmVzdGVkLWFjY291bnQta2V5LTMx==;EndpointSuffix=x"},
}
SECRETS = [PASSWORD, "sk-nested-api-key-31", "nested-private-key-31", "bmVzdGVkLWFjY291bnQta2V5LTMx"]


RECIPE = "tests.integration.mlflow_secrets_recipe:ServiceRecipe"


def with_password(uri: str) -> str:
    return uri.replace("http://", f"http://trainer:{PASSWORD}@")


def command(folder: Path, experiment: str) -> list[str]:
    args = {**NESTED, "record_dir": str(folder.parent / "record"), "step_seconds": 0.1, "num_samples": 256}
    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "s", "--save_folder", str(folder),
        "--recipe", RECIPE, "--recipe_args", json.dumps(args), "--max_duration", "3ep",
        "--save_interval", "1ep", "--global_batch_size", "32", "--seed", "7", "--log_every_n_steps", "1",
        "--mlflow_experiment", experiment,
    ]  # fmt: skip


def test_a_password_in_the_tracking_uri_and_nested_credentials_stay_in_the_process(
    tmp_path,
    tmp_path_factory,
    mlflow_server,  # noqa: F811 - the imported fixture
):
    from mlflow.tracking import MlflowClient

    uri = with_password(mlflow_server)
    shown = uri.replace(PASSWORD, "***")
    recipes = f"{os.environ['TRAIN_ALLOWED_RECIPES']},{RECIPE}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri, "TRAIN_ALLOWED_RECIPES": recipes}
    folder, experiment = tmp_path / "runs", f"secrets-{tmp_path.name}"
    logs = [tmp_path / f"{name}.log" for name in ("killed", "killed-again", "relaunched")]

    launch(command(folder, experiment), env, logs[0], kill_at_line="unit 1: step 12,")
    assert latest_step(folder / "s") == 8, "killed too late to test anything"
    kept = json.loads((folder / "s" / "mlflow.json").read_text())
    assert kept["tracking_uri"] == shown and f"at {shown}" in logs[0].read_text()
    launch(command(folder, experiment), env, logs[1], kill_at_line="unit 2: step 20,")
    assert f"MLflow run {kept['run_id']} continues" in logs[1].read_text()

    # a run folder written before this fix holds the URI with its password: the relaunch continues and rewrites it
    (folder / "s" / "mlflow.json").write_text(json.dumps({"run_id": kept["run_id"], "tracking_uri": uri}))
    launch(command(folder, experiment), env, logs[2])
    assert f"MLflow run {kept['run_id']} continues" in logs[2].read_text()
    assert json.loads((folder / "s" / "mlflow.json").read_text()) == kept

    client = MlflowClient(mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.run_id == kept["run_id"] and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 25))
    stored = json.dumps([run.data.params, run.data.tags])
    assert not [s for s in SECRETS if s in stored], stored
    assert json.loads(run.data.params["recipe_args"])["service"] == {"auth": "<redacted>", "region": "eu"}
    assert "AccountName=a;AccountKey=" not in stored  # the whole value went, not only the key in it

    printed = [line for log in logs for line in log.read_text().splitlines() if any(s in line for s in SECRETS)]
    assert not printed, printed
    assert PASSWORD.encode() not in b"".join(f.read_bytes() for f in (folder / "s").rglob("*") if f.is_file())
    # what the server stored (its SQLite file, artifacts, log): the fixture's folder, mlflow<N> in the session's temp
    server_files = [f for d in tmp_path_factory.getbasetemp().glob("mlflow*") for f in d.rglob("*") if f.is_file()]
    assert any(f.name == "mlflow.db" for f in server_files)
    assert not [f for f in server_files if any(s.encode() in f.read_bytes() for s in SECRETS)]


def test_a_server_that_refuses_is_warned_about_without_the_password(make_config, train_run, monkeypatch, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://trainer:{PASSWORD}@127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with caplog.at_level(logging.INFO):
        result = train_run(make_config(max_duration="1ep", mlflow_experiment="refused"))
    assert result.step == 8  # a metric never fails training
    warned = [r.getMessage() for r in caplog.records if "MLflow metrics are off" in r.getMessage()]
    assert warned and f"trainer:***@127.0.0.1:{port}" in warned[0], warned
    assert PASSWORD not in caplog.text
