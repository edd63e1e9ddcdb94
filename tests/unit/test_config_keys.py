"""TrainConfig takes its field names exactly and nothing else, from Python and from a flow-run parameter.

pydantic validates a flow's ``config`` parameter by calling TrainConfig(**dict), and pydantic-settings' constructor
matched 'Storage_Options' to storage_options and obeyed its own private keys: '_cli_parse_args' parsed a run's
hidden flags (storage_options included), '_env_prefix', '_env_file' and '_secrets_dir' chose what else to read.
Where the API's schema check is off (serve(), Python, enforce_parameter_schema: false) a run's creator reached the
worker's credentials that way. tests/integration/test_parameter_keys.py attacks the same through a real server.
"""

from __future__ import annotations

import inspect
import json

import pytest
from prefect.exceptions import ParameterTypeError
from pydantic_settings import BaseSettings

from flows.retrain import retrain
from flows.train import train
from training.config import ConfigError, TrainConfig

PRIVATE_KEYS = sorted(
    name for name in inspect.signature(BaseSettings.__init__).parameters if name.startswith("_") and name[1] != "_"
)
EVIL_OPTIONS = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}


def private_refusal(key: str) -> str:
    return f"TrainConfig: key {key!r} is not a field: keys starting with '_' are pydantic-settings' own options, never read here"


def test_every_private_init_key_of_pydantic_settings_is_known_here():
    assert {"_cli_parse_args", "_env_prefix", "_env_file", "_secrets_dir", "_cli_settings_source"} <= set(PRIVATE_KEYS)


@pytest.mark.parametrize("key", PRIVATE_KEYS)
def test_every_private_init_key_of_pydantic_settings_is_refused(key):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{key: None})
    assert str(info.value) == private_refusal(key)


def test_hidden_flags_cannot_smuggle_storage_options():
    with pytest.raises(ConfigError) as info:
        TrainConfig(_cli_parse_args=["--storage_options", json.dumps(EVIL_OPTIONS)])  # type: ignore[call-arg]
    assert str(info.value) == private_refusal("_cli_parse_args")


@pytest.mark.parametrize(
    "key, field",
    [("Storage_Options", "storage_options"), ("STORAGE_OPTIONS", "storage_options"),
     ("storage-options", "storage_options"), ("Seed", "seed"), ("RUN_NAME", "run_name")],
)  # fmt: skip
def test_a_field_name_in_another_case_is_refused_naming_the_field(key, field):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{key: {} if "options" in field.lower() else 1})
    assert str(info.value) == (
        f"TrainConfig: key {key!r} is not a field: field names are matched exactly, write {field!r}"
    )


def test_many_unknown_keys_are_one_line_that_names_the_first_and_counts_the_rest():
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{"x" * 5000: 1, "_env_file": "/etc/passwd", "bogus": 2})
    message = str(info.value)
    assert message.startswith("TrainConfig: key 'xxxxxxxx") and message.endswith("(and 2 more unknown keys)")
    assert "\n" not in message and len(message) < 250 and "/etc/passwd" not in message


@pytest.mark.parametrize(
    "key, expected",
    [("Storage_Options", "key 'Storage_Options' is not a field: field names are matched exactly, write "
                         "'storage_options'"),
     ("_cli_parse_args", "key '_cli_parse_args' is not a field: keys starting with '_' are pydantic-settings'"),
     ("_env_prefix", "key '_env_prefix' is not a field: keys starting with '_' are pydantic-settings'")],
)  # fmt: skip
@pytest.mark.parametrize("flow", [train, retrain], ids=["train", "retrain"])
def test_prefect_refuses_the_same_keys_when_it_validates_a_flow_run_parameter(flow, key, expected):
    """Flow.validate_parameters is what every flow-run process runs first (worker, serve(), a Python call)."""
    value = ["--storage_options", json.dumps(EVIL_OPTIONS)] if key == "_cli_parse_args" else EVIL_OPTIONS
    with pytest.raises(ParameterTypeError) as info:
        flow.validate_parameters({"config": {"recipe": "synthetic", key: value}})
    assert f"config: Value error, TrainConfig: {expected}" in str(info.value)


def test_storage_options_from_the_persons_own_python_still_arrive():
    config = TrainConfig(storage_options=EVIL_OPTIONS)
    validated = train.validate_parameters({"config": config})
    assert validated["config"] is config and validated["config"].storage_options == EVIL_OPTIONS
