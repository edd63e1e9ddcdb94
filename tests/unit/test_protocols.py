"""Object stores beyond S3: a missing fsspec package is one line naming the extra, before anything is written;
S3_ENDPOINT_URL (Composer's variable) reaches a real S3 endpoint over HTTP (moto)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from checkpointing import CheckpointStore
from checkpointing.io.protocols import with_endpoint_alias
from tests.conftest import ROOT
from training.config import TrainConfig, describe_error


@pytest.fixture
def no_cloud_packages(monkeypatch):
    """gcsfs and adlfs as if not installed (a None entry in sys.modules makes their import fail)."""
    for name in ("gcsfs", "adlfs"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize(
    "option, url, extra",
    [
        ("save_folder", "gs://b/runs", "gcs"),
        ("save_folder", "gcs://b/runs", "gcs"),
        ("save_folder", "az://container/runs", "azure"),
        ("save_folder", "abfs://container/runs", "azure"),
        ("load_path", "gs://b/model.safetensors", "gcs"),
        ("export_on_complete", "az://c/model.pt", "azure"),
    ],
)
def test_a_missing_store_package_is_one_line_naming_the_extra(no_cloud_packages, option, url, extra):
    with pytest.raises(ValidationError) as info:
        TrainConfig(**{option: url})
    assert (
        describe_error(info.value)
        == f"{option}={url!r}: install the {extra} extra: pip install 'resumable-train[{extra}]'"
    )


def test_an_unknown_protocol_is_named():
    with pytest.raises(ValidationError) as info:
        TrainConfig(save_folder="nosuch://b/runs")
    assert describe_error(info.value).startswith("save_folder='nosuch://b/runs': protocol 'nosuch' is not supported")


@pytest.mark.slow  # a python process that imports flows.train (torch, Prefect)
def test_the_cli_exits_2_with_the_extra_and_writes_nothing(tmp_path):
    # A fresh interpreter with gcsfs hidden, as on a machine without the [gcs] extra.
    code = "import sys; sys.modules['gcsfs'] = None; from flows.train import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "--save_folder", "gs://b/runs", "--run_name", "x"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.splitlines()[-1]
        == "error: save_folder='gs://b/runs': install the gcs extra: pip install 'resumable-train[gcs]'"
    )
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_s3_endpoint_url_is_used_only_when_nothing_else_names_an_endpoint(monkeypatch):
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://alias:1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert with_endpoint_alias("s3://b/x", None) == {"client_kwargs": {"endpoint_url": "http://alias:1"}}
    assert with_endpoint_alias("s3://b/x", {"anon": False}) == {
        "anon": False,
        "client_kwargs": {"endpoint_url": "http://alias:1"},
    }
    given = {"client_kwargs": {"endpoint_url": "http://given:2"}}
    assert with_endpoint_alias("s3://b/x", given) == given
    assert with_endpoint_alias("memory://x", None) == {}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://aws:3")  # botocore reads this one itself
    assert with_endpoint_alias("s3://b/x", None) == {}


def test_s3_endpoint_url_alone_reaches_the_s3_server(s3, monkeypatch):
    folder, options = s3
    monkeypatch.setenv("S3_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    store = CheckpointStore(folder, "exp")  # no storage_options: the endpoint comes from S3_ENDPOINT_URL
    store.save(
        "ep1-ba1-sa4", {"state.pt": {"state": {"model": {"w": torch.arange(4.0)}}}}, progress={"samples_seen": 4}
    )

    seen_by_s3 = CheckpointStore(folder, "exp", storage_options=options)  # read back with the endpoint given outright
    loaded = seen_by_s3.load(seen_by_s3.latest(), files=["state.pt"])
    assert torch.equal(loaded.objects["state.pt"]["state"]["model"]["w"], torch.arange(4.0))
