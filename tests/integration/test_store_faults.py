"""The store against S3 over HTTP through a fault-injecting proxy: transient faults are absorbed by our
tenacity layer, permanent ones fail at once, credentials go nowhere, and async uploads never tear."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import s3fs
import torch

from checkpointing import CheckpointStore, RetrySettings, StorageError, Writer
from flows.train import train
from tests.faults import FaultProxy

FAST_RETRY = RetrySettings(attempts=12, max_seconds=60, initial_wait=0.01, max_wait=0.1)


@pytest.fixture
def no_library_retries(monkeypatch):
    """s3fs and botocore retry some faults themselves; turn that off so that OUR retry layer is what is tested."""
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return {"config_kwargs": {"retries": {"max_attempts": 1}}}


def through(proxy: FaultProxy, **extra) -> dict:
    return {"client_kwargs": {"endpoint_url": proxy.endpoint}, **extra}


def test_twenty_percent_transient_faults_are_absorbed_and_every_checkpoint_verifies(s3, moto_server,
                                                                                    no_library_retries):
    folder, _ = s3
    with FaultProxy(moto_server, fault_rate=0.2, seed=1) as proxy:
        store = CheckpointStore(folder, "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY)
        for i in range(8):
            store.save(f"c{i}", {"state.pt": {"w": torch.full((1000,), float(i))}}, progress={"samples_seen": i},
                       writer=Writer.current(1))
        assert [i.name for i in store.list()] == [f"c{i}" for i in range(8)]
        assert all(store.check(i, deep=True) == [] for i in store.list())
        assert torch.equal(store.load_latest().objects["state.pt"]["w"], torch.full((1000,), 7.0))
        assert proxy.injected() >= 10  # the faults really happened


def test_permanent_errors_fail_at_once_naming_the_operation(s3, moto_server, no_library_retries):
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        proxy.deny = re.compile(r"PUT .*/checkpoints/c0/state\.pt")
        store = CheckpointStore(folder, "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY)
        with pytest.raises(StorageError, match=r"put checkpoints/c0/state.pt at .* failed \(permanent\)"):
            store.save("c0", {"state.pt": {"w": torch.ones(1)}}, progress={"samples_seen": 1})
        puts = [r for r in proxy.requests if r[0] == "PUT" and r[1].endswith("c0/state.pt")]
        assert puts == [("PUT", puts[0][1], 403)]  # tried exactly once

        proxy.deny = None
        missing = CheckpointStore("s3://no-such-bucket-here/runs", "r", storage_options=through(proxy), retry=FAST_RETRY)
        with pytest.raises(StorageError, match="no such bucket"):
            missing.save("c0", {"state.pt": {"w": torch.ones(1)}}, progress={"samples_seen": 1})


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_a_full_training_run_completes_through_twenty_percent_faults(s3, moto_server, no_library_retries, make_config):
    folder, _ = s3
    with FaultProxy(moto_server, fault_rate=0.2, seed=2) as proxy:
        config = make_config(save_folder=folder, storage_options=through(proxy, **no_library_retries),
                             max_duration="4ep", store_retry_attempts=12)
        result = train(config)
        assert (result.epoch, result.samples_seen) == (4, 4 * 256)
        store = CheckpointStore(folder, "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY)
        assert len(store.list()) == 4
        assert all(store.check(i, deep=True) == [] for i in store.list())
        assert proxy.injected() >= 5


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_credentials_in_storage_options_are_never_stored_or_logged(s3, moto_server, make_config, caplog):
    folder, options = s3
    secret = "S3CR3T-never-store-me"
    # moto accepts any key pair; a user might (unwisely) pass credentials this way.
    config = make_config(save_folder=folder, max_duration="2ep",
                         storage_options={**options, "key": "AKIAEXAMPLEKEY", "secret": secret})
    result = train(config)

    fs = s3fs.S3FileSystem(**options)
    for path in fs.find(folder):
        assert secret.encode() not in fs.cat_file(path), path
    assert secret not in caplog.text
    from prefect import get_client

    async def parameters():
        async with get_client() as client:
            runs = await client.read_flow_runs()
            return [r.parameters for r in runs if r.name == config.run_name]

    import asyncio

    stored = asyncio.run(parameters())
    assert stored and all(secret not in json.dumps(p, default=str) for p in stored)
    assert result.epoch == 2


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_training_goes_on_while_an_upload_is_in_flight_and_latest_waits_for_it(s3, moto_server, make_config, tmp_path):
    folder, _ = s3
    record = tmp_path / "ids"
    with FaultProxy(moto_server) as proxy:
        proxy.hold = re.compile(r"PUT .*/checkpoints/ep1-[^/]*/state\.pt")  # unit 0's upload
        config = make_config(save_folder=folder, storage_options=through(proxy), max_duration="3ep",
                             async_upload=True, recipe_args={"num_samples": 256, "record_dir": str(record)})
        outcome: dict = {}
        runner = threading.Thread(target=lambda: outcome.update(result=train(config)))
        runner.start()
        assert proxy.held.wait(timeout=120), "unit 0's upload never started"
        steps_per_epoch = 256 // 32
        deadline = time.monotonic() + 60
        while len((record / "ids-rank0.txt").read_text().splitlines()) <= steps_per_epoch:
            assert time.monotonic() < deadline, "unit 1 did not train while unit 0 uploaded"
            time.sleep(0.01)
        store = CheckpointStore(folder, "r", storage_options=through(proxy))
        assert store.read_pointer() is None  # unit 1 trains, yet latest has not moved: upload in flight
        proxy.release.set()
        runner.join(timeout=120)

    result = outcome["result"]
    assert result.units[1].resumed_from.endswith("(in memory; its upload is in flight)")
    assert (result.epoch, result.samples_seen) == (3, 768)
    store = CheckpointStore(folder, "r", storage_options=s3[1])
    assert [i.name for i in store.list()] == [u.checkpoint_name for u in result.units]
    assert all(store.check(i, deep=True) == [] for i in store.list())


@pytest.mark.slow
def test_a_kill_during_an_upload_leaves_latest_on_the_previous_verified_checkpoint(s3, moto_server, prefect_env,
                                                                                    tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    folder, options = s3
    args = ["--run_name", "k", "--recipe", "recipes.synthetic:SyntheticRecipe", "--max_duration", "3ep",
            "--global_batch_size", "32", "--seed", "7", "--unit_retries", "0", "--async_upload", "true"]
    env = {**prefect_env, **{k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                         "AWS_DEFAULT_REGION")}}

    def launch(save_folder: str, endpoint: str, log: str) -> subprocess.Popen:
        child_env = {**env, "TRAIN_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}})}
        return subprocess.Popen([sys.executable, "-m", "flows.train", "--save_folder", save_folder, *args], cwd=ROOT,
                                env=child_env, stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT)

    direct = options["client_kwargs"]["endpoint_url"]
    reference = launch(folder.replace("/runs", "/reference"), direct, "reference.log")
    with FaultProxy(moto_server) as proxy:
        proxy.hold = re.compile(r"PUT .*/checkpoints/ep2-[^/]*/state\.pt")  # unit 1's upload
        victim = launch(folder, proxy.endpoint, "victim.log")
        assert proxy.held.wait(timeout=180), (tmp_path / "victim.log").read_text()[-2000:]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        proxy.deny = re.compile(".")  # the dead process's held request must not land either
        proxy.release.set()

    store = CheckpointStore(folder, "k", storage_options=options)
    latest = store.latest(deep=True)
    assert latest.name.startswith("ep1-") and store.check(latest, deep=True) == []
    assert [i.name for i in store.list()] == [latest.name]  # the torn upload has no manifest
    relaunched = launch(folder, direct, "relaunched.log")
    assert relaunched.wait(timeout=300) == 0, (tmp_path / "relaunched.log").read_text()[-3000:]
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    ours = store.load_latest(["state.pt"]).objects["state.pt"]["state"]["model"]
    ref = CheckpointStore(folder.replace("/runs", "/reference"), "k", storage_options=options)
    theirs = ref.load_latest(["state.pt"]).objects["state.pt"]["state"]["model"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
