"""Secrets never leave the process (checkpointing/io/redact.py): URIs with a password, presigned S3 and GCS URLs,
Azure SAS URLs and connection strings, credentials nested in parameters; what is not a secret stays as it was.
The MLflow side, against a real server: tests/integration/test_mlflow_secrets.py."""

from __future__ import annotations

import json
import logging

import pytest

from checkpointing.io.redact import credential_keys, is_credential_name, redact, redact_text, redact_uri
from flows.run_summary import summary_markdown  # imports Prefect, whose logging setup must come before caplog's
from training.metrics.mlflow_log import params_of

PASSWORD = "pa55-never-shown"

PRESIGNED_S3 = (
    "https://team.s3.amazonaws.com/runs/a/model.pt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20261205%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20261205T180000Z"
    "&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Security-Token=FwoGZXIvYXdzEXAMPLE"
    "&X-Amz-Signature=4f0c9e8f1d2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4"
)
SAS = "https://acct.blob.core.windows.net/c/shard-0.bin?sv=2022-11-02&se=2026-12-06&sr=b&sp=r&sig=Zm9vYmFyYmF6%3D"
GCS = "https://storage.googleapis.com/b/o?GoogleAccessId=svc%40p.iam&Expires=1733000000&Signature=c2lnbmF0dXJl"
CONNECTION = "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=bXktYWNjb3VudC1rZXk9PQ==;EndpointSuffix=core.windows.net"
SECRETS = (PASSWORD, "AKIAIOSFODNN7EXAMPLE", "FwoGZXIvYXdzEXAMPLE", "4f0c9e8f1d2a", "Zm9vYmFyYmF6", "c2lnbmF0dXJl")


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (f"http://trainer:{PASSWORD}@127.0.0.1:5000", "http://trainer:***@127.0.0.1:5000"),
        (f"https://trainer:{PASSWORD}@mlflow.example.com/path?x=1", "https://trainer:***@mlflow.example.com/path?x=1"),
        (f"https://{PASSWORD}@git.example.com/repo.git", "https://***@git.example.com/repo.git"),  # a token as user
        (f"abfs://runs:{PASSWORD}@acct.dfs.core.windows.net/a", "abfs://runs:***@acct.dfs.core.windows.net/a"),
        (f"https://h/api?token={PASSWORD}&page=2", "https://h/api?token=***&page=2"),
        (f"https://h/api?api_key={PASSWORD}&access_token={PASSWORD}", "https://h/api?api_key=***&access_token=***"),
        (f"https://h/cb#access_token={PASSWORD}&state=1", "https://h/cb#access_token=***&state=1"),
    ],
)
def test_a_uri_loses_its_password_and_credential_parameters(uri, shown):
    assert redact_uri(uri) == shown
    assert PASSWORD not in redact_text(f"MLflow run 1 at {uri}: failed")


@pytest.mark.parametrize("uri", [PRESIGNED_S3, SAS, GCS])
def test_a_signed_url_keeps_its_parameter_names_and_no_value(uri):
    shown = redact_uri(uri)
    names = [p.split("=")[0] for p in uri.split("?")[1].split("&")]
    assert shown == uri.split("?")[0] + "?" + "&".join(f"{n}=***" for n in names)
    assert not [s for s in SECRETS if s in shown]


@pytest.mark.parametrize(
    "uri",
    [
        "s3://team/runs/exp1",
        "abfs://container@acct.dfs.core.windows.net/runs",  # the userinfo names the container: kept
        "gs://b/runs?generation=3",
        "/tmp/runs/exp1",
        "memory://runs",
        "http://127.0.0.1:5000",
        "https://h/p?page=2&q=a%20b#frag",
        "https://h/p?",
    ],
)
def test_a_uri_without_secrets_is_unchanged(uri):
    assert redact_uri(uri) == uri


def test_an_unparseable_uri_shows_only_its_scheme():
    assert redact_uri(f"http://trainer:{PASSWORD}@[::1:5000/") == "http://***"


def test_credentials_nested_anywhere_in_parameters_are_redacted():
    params = {
        "lr": 0.01,
        "service": {"auth": {"api_key": PASSWORD}, "endpoint": f"https://u:{PASSWORD}@svc.example.com"},
        "keys": [{"private_key": PASSWORD, "name": "deploy"}, {"sessionToken": PASSWORD}],
        "azure": {"connection_string": CONNECTION, "container": "runs"},
        "note": CONNECTION,
        "data_url": SAS,
        "load_ignore_keys": ["head.weight"],
        "max_tokens": 512,
    }
    shown = redact(params)
    assert PASSWORD not in json.dumps(shown) and "bXktYWNjb3VudC1rZXk9PQ" not in json.dumps(shown)
    assert shown["service"] == {"auth": "<redacted>", "endpoint": "https://u:***@svc.example.com"}
    assert shown["keys"] == [{"private_key": "<redacted>", "name": "deploy"}, {"sessionToken": "<redacted>"}]
    assert shown["azure"] == {"connection_string": "<redacted>", "container": "runs"}
    assert shown["note"] == CONNECTION.replace("bXktYWNjb3VudC1rZXk9PQ==", "***")  # AccountName stays
    assert (shown["lr"], shown["load_ignore_keys"], shown["max_tokens"]) == (0.01, ["head.weight"], 512)
    assert params["service"]["auth"]["api_key"] == PASSWORD  # a copy: the run still has its values


@pytest.mark.parametrize(
    "name",
    ["api_key", "apiKey", "APIKey", "X-Api-Key", "aws_secret_access_key", "AccountKey", "connectionString",
     "private_key", "passwd", "Authorization", "bearer", "session_token", "client_secret", "cookie", "sas", "key"],
)  # fmt: skip
def test_credential_like_names(name):
    assert is_credential_name(name)


@pytest.mark.parametrize(
    "name", ["endpoint_url", "load_ignore_keys", "max_tokens", "tokenizer", "data_url", "vocab_size", "monkey"]
)
def test_names_that_are_not_credentials(name):
    assert not is_credential_name(name)


def test_credential_keys_lists_nested_names_outermost_first():
    options = {"client_kwargs": {"endpoint_url": "http://h", "aws_session_token": "x"}, "key": "k"}
    assert credential_keys(options) == ["key", "aws_session_token"]
    assert credential_keys([{"a": [{"secret": 1}]}]) == ["secret"]


def test_mlflow_params_hold_no_nested_credential(make_config):
    config = make_config(
        recipe_args={
            "num_samples": 256,
            "service": {"auth": {"api_key": PASSWORD}},
            "deploy": {"private_key": PASSWORD},
            "azure": {"connection_string": CONNECTION},
        }
    )
    params = params_of(config)
    assert PASSWORD not in json.dumps(params) and "bXktYWNjb3VudC1rZXk9PQ" not in json.dumps(params)
    assert json.loads(params["recipe_args"]) == {
        "num_samples": 256,
        "service": {"auth": "<redacted>"},
        "deploy": {"private_key": "<redacted>"},
        "azure": {"connection_string": "<redacted>"},
    }


def test_the_gpt_recipe_refuses_what_the_word_list_names():
    from recipes.gpt import GPTRecipe

    headers = {"client_kwargs": {"headers": {"Authorization": f"Bearer {PASSWORD}"}}}  # not named by its old list
    with pytest.raises(ValueError, match="data_options: 'Authorization' looks like a credential; recipe_args are"):
        GPTRecipe(data_url="s3://b/tokens", vocab_size=65, data_options=headers)
    with pytest.raises(ValueError, match="data_options: 'aws_secret_access_key' looks like a credential"):
        GPTRecipe(data_url="s3://b/tokens", vocab_size=65, data_options={"aws_secret_access_key": PASSWORD})


def test_a_run_whose_store_uri_carries_a_password_logs_and_summarises_it_masked(train_run, caplog, tmp_path):
    """memory:// takes any path, so a userinfo in save_folder reaches every line that names the store."""
    import fsspec

    from checkpointing import CheckpointStore
    from training.config import TrainConfig

    folder = f"memory://trainer:{PASSWORD}@host/{tmp_path.name}"
    config = TrainConfig(
        run_name="r", save_folder=folder, recipe="recipes.synthetic:SyntheticRecipe", recipe_args={"num_samples": 64},
        max_duration="1ep", save_interval="1ep", global_batch_size=32, seed=7, unit_retries=0,
    )  # fmt: skip
    try:
        with caplog.at_level(logging.INFO):
            result = train_run(config)
        store = CheckpointStore(folder, "r")
        summary = summary_markdown(config, store, result.units, result.metrics, result.started_from, store.list(),
                                   store.storage.uri("loss.svg"), {})  # fmt: skip
    finally:
        fsspec.filesystem("memory").rm(folder.removeprefix("memory://"), recursive=True)
    assert result.step == 2 and "trainer:***@host" in caplog.text and "trainer:***@host" in summary
    assert PASSWORD not in caplog.text and PASSWORD not in summary
