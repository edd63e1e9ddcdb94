"""Migrating users' workflows through the run's lifecycle (``train_run``, as the train flow drives it): export on
completion, warm start from weights files on local, memory:// and S3 over HTTP (moto), a new head via
load_ignore_keys, hostile files refused before anything is written, and S3_ENDPOINT_URL as the only endpoint
setting; and through the command line (``python -m flows.train``, ``main``)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.peers.formats import read_weights
from flows.train import main
from tests.conftest import ROOT
from tests.interop_stores import STORES, put, store_root, torch_bytes
from training.config import ConfigError


def final_weights(config) -> dict[str, torch.Tensor]:
    store = CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options)
    return store.load(store.latest(), files=["state.pt"]).objects["state.pt"]["state"]["model"]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", STORES)
def test_export_on_complete_then_warm_start_from_that_file_gives_the_same_weights(
    kind, make_config, request, tmp_path, train_run
):
    root, options = store_root(kind, request, tmp_path)
    export_uri = f"{root}/release/model.safetensors"
    source = make_config(
        run_name="source", save_folder=f"{root}/runs", storage_options=options, export_on_complete=export_uri
    )
    train_run(source)

    exported = read_weights(export_uri, options)
    assert_same(exported.state_dict, final_weights(source))
    assert exported.metadata["recipe"] == source.recipe
    assert exported.metadata["product_version"] == importlib.metadata.version("resumable-train")

    # lr=0 leaves the weights untouched: the new run's weights must be exactly the file's.
    tuned = make_config(
        run_name="tuned",
        save_folder=f"{root}/runs",
        storage_options=options,
        max_duration="1ep",
        load_path=export_uri,
        recipe_args={"num_samples": 256, "lr": 0.0},
    )
    result = train_run(tuned)
    assert result.units[0].resumed_from == f"weights of {export_uri} (load_path: a safetensors file)"
    assert (result.epoch, result.step, result.samples_seen) == (1, 8, 256)  # a weights file starts progress anew
    assert_same(final_weights(tuned), final_weights(source))


@pytest.mark.parametrize("from_folder", [False, True], ids=["composer file", "checkpoint folder"])
def test_a_new_head_fine_tunes_from_old_weights_with_load_ignore_keys(from_folder, make_config, tmp_path, train_run):
    done = train_run(make_config(run_name="base", max_duration="1ep"))
    base = final_weights(make_config(run_name="base"))
    if from_folder:
        load_path, extra = done.checkpoint, {"load_weights_only": True}
    else:
        load_path, extra = str(tmp_path / "composer.pt"), {}
        put(load_path, torch_bytes({"state": {"model": base, "optimizers": {}}}), {})
    tuned = make_config(
        run_name="five-classes",
        max_duration="1ep",
        load_path=load_path,
        load_ignore_keys=["3.*"],  # the classifier: 4 classes in the file, 5 in the new model
        recipe_args={"num_samples": 256, "lr": 0.0, "num_classes": 5},
        **extra,
    )
    train_run(tuned)
    after = final_weights(tuned)
    assert torch.equal(after["0.weight"], base["0.weight"]) and torch.equal(after["0.bias"], base["0.bias"])
    assert after["3.weight"].shape == (5, 32)


def test_a_mismatched_file_fails_the_run_before_anything_is_written(make_config, tmp_path, train_run):
    weights = tmp_path / "w.pt"
    weights.write_bytes(torch_bytes(train_and_take_weights(make_config, train_run)))
    config = make_config(run_name="wider", load_path=str(weights), recipe_args={"num_samples": 256, "hidden": 8})
    with pytest.raises(ConfigError) as info:
        train_run(config)
    assert str(info.value).startswith(f"load_path={str(weights)!r}: the weights do not match the model: 3 of another")
    assert not os.path.exists(os.path.join(config.save_folder, "wider"))  # not even a writer claim


def train_and_take_weights(make_config, train_run) -> dict[str, torch.Tensor]:
    config = make_config(run_name="donor", max_duration="1ep")
    train_run(config)
    return final_weights(config)


@pytest.mark.slow  # a python -m flows.train process on a Prefect test server
def test_the_cli_refuses_a_code_running_pickle_with_exit_2_and_writes_nothing(prefect_env, tmp_path):
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "evil.pt").write_bytes(torch_bytes({"model": Payload()}))
    folder = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "--save_folder", str(folder), "--load_path", str(tmp_path / "evil.pt")],
        cwd=ROOT,
        env=prefect_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr  # checked before Prefect starts: no flow traceback
    assert proc.stderr.startswith(
        f"error: load_path={str(tmp_path / 'evil.pt')!r}: refused: the file needs code to load ("
    )
    assert not marker.exists()
    assert not (folder / "default").exists()


def test_s3_endpoint_url_alone_points_a_run_at_the_s3_server(s3, make_config, monkeypatch, train_run):
    folder, options = s3
    monkeypatch.setenv("S3_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    result = train_run(make_config(save_folder=folder, max_duration="2ep"))  # no storage_options

    store = CheckpointStore(folder, "r", storage_options=options)
    assert result.checkpoint.startswith(f"{folder}/r/checkpoints/")
    assert [i.name for i in store.list()] == [u.checkpoint_name for u in result.units]


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")  # main() runs the train flow in this process
def test_a_run_that_resumes_ignores_a_load_path_that_is_gone(make_config, tmp_path, train_run):
    first = make_config(max_duration="1ep")
    train_run(first)
    argv = ["--save_folder", first.save_folder, "--run_name", "r", "--recipe", first.recipe, "--seed", "7"]
    argv += ["--recipe_args", '{"num_samples": 256}', "--global_batch_size", "32", "--max_duration", "2ep"]
    # The warm-start file of the original command line has since been deleted: the run resumes anyway.
    assert main([*argv, "--load_path", str(tmp_path / "gone.safetensors")]) == 0
    assert len(CheckpointStore(first.save_folder, "r").list()) == 2
