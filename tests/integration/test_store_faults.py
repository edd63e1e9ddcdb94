"""The store against S3 over HTTP through a fault-injecting proxy: transient faults are absorbed by our
tenacity layer, permanent ones fail at once, credentials go nowhere, and async uploads never tear.

s3fs and botocore retry some faults themselves; these tests turn that off (``no_library_retries``) so that
what absorbs the faults is ``checkpointing.io.storage``, and they check that it did (its retry warnings).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import s3fs
import torch

from checkpointing import (
    AccessDeniedError,
    CheckpointStore,
    PermanentStorageError,
    RetrySettings,
    StorageError,
    Writer,
)
from checkpointing.io.storage import Storage
from flows.train import train
from tests.conftest import MOTO_SECRET_KEY, RECORDING, wait_until
from tests.faults import DROP, DROP_AFTER, FaultProxy, error_xml

FAST_RETRY = RetrySettings(attempts=12, max_seconds=60, initial_wait=0.01, max_wait=0.1)
RETRY_LOG = "checkpointing.io.storage"


@pytest.fixture
def no_library_retries(monkeypatch):
    """One attempt per request in s3fs (class attribute) and botocore (total_max_attempts includes the first)."""
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def through(proxy: FaultProxy, **extra) -> dict:
    return {"client_kwargs": {"endpoint_url": proxy.endpoint}, **extra}


def our_retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RETRY_LOG and "retrying in" in r.getMessage()]


TRANSIENT = {  # what a store or the network in front of it answers, that a retry cures
    "503 SlowDown": (503, "application/xml", error_xml("SlowDown", "Please reduce your request rate.")),
    "500 InternalError": (500, "application/xml", error_xml("InternalError", "We encountered an internal error.")),
    "502 from a proxy, HTML": (502, "text/html", b"<html><body>Bad Gateway</body></html>"),
    "504 without a body": (504, "text/plain", b""),
    "429 TooManyRequests": (429, "application/xml", error_xml("TooManyRequests", "Too many requests")),
    "400 RequestTimeout": (
        400,
        "application/xml",
        error_xml(
            "RequestTimeout", "Your socket connection to the server was not read from within the timeout period."
        ),
    ),
    "connection dropped": DROP,
    "write landed, reply lost": DROP_AFTER,
}
PERMANENT = {  # ... and what no retry cures
    "403 AccessDenied": (403, "application/xml", error_xml("AccessDenied", "Access Denied")),
    "403 InvalidAccessKeyId": (
        403,
        "application/xml",
        error_xml("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
    ),
    "400 InvalidArgument quoting 500": (
        400,
        "application/xml",
        error_xml("InvalidArgument", "Part 500 of checkpoints/step-500 is invalid"),
    ),
}


PATTERN = {"put": r"PUT .*/runs/obj$", "get": r"(GET|HEAD) .*/runs/obj$"}  # get_hashed: HEAD, then GET
# A HEAD answer has no body, so s3fs cannot tell a 4xx's code there; permanent errors are sent to the GET.
PERMANENT_PATTERN = {"put": PATTERN["put"], "get": r"GET .*/runs/obj$"}


def _do(storage: Storage, op: str) -> bytes:
    if op == "put":
        storage.put("obj", b"payload")
    return storage.get_hashed("obj")[0]


@pytest.mark.parametrize(
    "op, fault", [(op, f) for op in PATTERN for f in TRANSIENT if (op, f) != ("get", "400 RequestTimeout")]
)  # S3 sends that on uploads only
def test_a_transient_fault_is_retried_by_our_layer_until_it_passes(
    s3, moto_server, no_library_retries, caplog, op, fault
):
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        storage = Storage(folder, through(proxy, **no_library_retries), FAST_RETRY)
        storage.put("obj", b"payload")
        proxy.forget()
        proxy.script(PATTERN[op], TRANSIENT[fault], TRANSIENT[fault])
        with caplog.at_level(logging.WARNING, logger=RETRY_LOG):
            assert _do(storage, op) == b"payload"
        status = TRANSIENT[fault] if isinstance(TRANSIENT[fault], int) else TRANSIENT[fault][0]
        seen = proxy.seen(PATTERN[op])
        assert seen[:2] == [status, status] and seen[-1] in (200, 206)  # two faults, then through
        assert our_retries(caplog) and all(f"{op} obj failed" in m for m in our_retries(caplog))


@pytest.mark.parametrize("op", list(PATTERN))
@pytest.mark.parametrize("fault", list(PERMANENT))
def test_a_permanent_error_fails_at_once_naming_the_operation(s3, moto_server, no_library_retries, caplog, fault, op):
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        storage = Storage(folder, through(proxy, **no_library_retries), FAST_RETRY)
        storage.put("obj", b"payload")
        proxy.forget()
        proxy.script(PERMANENT_PATTERN[op], PERMANENT[fault])
        with caplog.at_level(logging.WARNING, logger=RETRY_LOG), pytest.raises(StorageError) as failed:
            _do(storage, op)
        if fault.startswith("403"):  # a type the retry policy and the CLI decide on, and a message that says why
            assert isinstance(failed.value, AccessDeniedError)
            assert re.search(
                rf"{op} obj at s3://.*/runs failed: access denied; check the credentials", str(failed.value)
            )
        else:
            assert isinstance(failed.value, PermanentStorageError)
            assert re.search(rf"{op} obj at s3://.*/runs failed \(permanent\)", str(failed.value)), failed.value
        assert proxy.seen(PERMANENT_PATTERN[op]) == [PERMANENT[fault][0]]  # asked once
        assert our_retries(caplog) == []  # so no retry delay either


def test_a_denied_write_fails_at_once_and_latest_stays_put(s3, moto_server, no_library_retries, caplog):
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        store = CheckpointStore(folder, "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY)
        store.save("c0", {"state.pt": {"w": torch.zeros(1)}}, progress={"samples_seen": 1})
        proxy.deny = re.compile(r"PUT .*/checkpoints/c1/state\.pt")
        with (
            caplog.at_level(logging.WARNING, logger=RETRY_LOG),
            pytest.raises(
                AccessDeniedError,
                match=r"put checkpoints/c1/state\.pt at .* failed: access denied; check the credentials .*"
                r"\(PermissionError: Access Denied\)",
            ),
        ):
            store.save("c1", {"state.pt": {"w": torch.ones(1)}}, progress={"samples_seen": 2})
        assert proxy.seen(r"PUT .*/checkpoints/c1/state\.pt") == [403]
        assert our_retries(caplog) == []
        assert store.latest().name == "c0"


def test_a_bucket_that_does_not_exist_fails_at_the_first_read_not_as_an_empty_run(
    moto_server, s3, no_library_retries, caplog
):
    with FaultProxy(moto_server) as proxy:
        store = CheckpointStore(
            "s3://no-such-bucket-here/runs", "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY
        )
        with caplog.at_level(logging.WARNING, logger=RETRY_LOG):
            with pytest.raises(
                PermanentStorageError,
                match=r"list checkpoints at s3://no-such-bucket-here/runs/r failed \(permanent\)"
                r": no such bucket .*fix save_folder",
            ):
                store.latest()  # before the fix: None, and a run would silently start from scratch
            with pytest.raises(StorageError, match="no such bucket"):
                store.save("c0", {"state.pt": {"w": torch.ones(1)}}, progress={"samples_seen": 1})
        # Each request once: no retries. (latest() lists the checkpoints first; save() reads the pointer.)
        assert proxy.seen(r"GET /no-such-bucket-here\?list-type=2&prefix=runs%2Fr%2Fcheckpoints%2F") == [404]
        assert proxy.seen(r"GET /no-such-bucket-here/runs/r/latest$") == [404]  # a capped read: a ranged GET
        assert our_retries(caplog) == []
        assert our_retries(caplog) == []


def test_twenty_percent_transient_faults_are_absorbed_and_every_checkpoint_verifies(
    s3, moto_server, no_library_retries, caplog
):
    folder, _ = s3
    with FaultProxy(moto_server, fault_rate=0.2, seed=1) as proxy, caplog.at_level(logging.WARNING, logger=RETRY_LOG):
        store = CheckpointStore(folder, "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY)
        for i in range(5):
            store.save(
                f"c{i}",
                {"state.pt": {"w": torch.full((1000,), float(i))}},
                progress={"samples_seen": i},
                writer=Writer.current(1),
            )
            assert torch.equal(store.load_latest().objects["state.pt"]["w"], torch.full((1000,), float(i)))
        assert [i.name for i in store.list()] == [f"c{i}" for i in range(5)]
        assert all(store.check(i, deep=True) == [] for i in store.list())
        assert proxy.injected() >= 10  # the faults really happened
        assert len(our_retries(caplog)) >= 5  # and our layer, not a library's, absorbed them


@pytest.mark.slow
def test_a_full_training_run_completes_through_twenty_percent_faults(
    s3, moto_server, no_library_retries, make_config, caplog, train_run
):
    folder, _ = s3
    with FaultProxy(moto_server, fault_rate=0.2, seed=2) as proxy, caplog.at_level(logging.WARNING, logger=RETRY_LOG):
        config = make_config(
            save_folder=folder,
            storage_options=through(proxy, **no_library_retries),
            max_duration="4ep",
            store_retry_attempts=12,
            unit_retries=0,
        )  # no Prefect retry to help
        result = train_run(config)
        assert (result.epoch, result.samples_seen) == (4, 4 * 256)
        store = CheckpointStore(folder, "r", storage_options=through(proxy, **no_library_retries), retry=FAST_RETRY)
        assert [i.name for i in store.list()] == [u.checkpoint_name for u in result.units]
        assert all(store.check(i, deep=True) == [] for i in store.list())
        assert proxy.injected() >= 5 and our_retries(caplog)


def _files_holding(secret: str, *folders: Path) -> list[str]:
    return [
        str(p) for folder in folders for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()
    ]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_credentials_are_never_stored_or_logged(s3, moto_server, make_config, caplog, tmp_path):
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_DATABASE_CONNECTION_URL

    folder, options = s3
    secret = "S3CR3T-never-store-me"  # moto accepts any key pair; a user might (unwisely) pass one in the options
    config = make_config(
        save_folder=folder, max_duration="2ep", storage_options={**options, "key": "AKIAEXAMPLEKEY", "secret": secret}
    )
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="prefect")
    result = train(config)
    assert result.epoch == 2

    fs = s3fs.S3FileSystem(**options)
    stored = {path: fs.cat_file(path) for path in fs.find(folder)}
    assert any(p.endswith("/latest") for p in stored) and any(p.endswith("/manifest.json") for p in stored)
    for leaked in (secret, MOTO_SECRET_KEY):  # the one in the options, the one in the environment
        assert [p for p, data in stored.items() if leaked.encode() in data] == []
        assert "unit" in caplog.text and leaked not in caplog.text  # the run's log lines were captured
        assert leaked not in result.model_dump_json()
        database = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1]).parent
        assert list(database.glob("*.db"))  # the Prefect API's database: parameters, logs, artifacts, states
        assert _files_holding(leaked, database, PREFECT_HOME.value()) == []


@pytest.mark.slow
def test_training_goes_on_while_an_upload_is_in_flight_and_latest_waits_for_it(
    s3, moto_server, make_config, tmp_path, train_run
):
    folder, _ = s3
    record = tmp_path / "ids"
    with FaultProxy(moto_server) as proxy:
        proxy.hold = re.compile(r"PUT .*/checkpoints/ep1-[^/]*/state\.pt")  # unit 0's upload
        config = make_config(
            save_folder=folder,
            storage_options=through(proxy),
            max_duration="3ep",
            async_upload=True,
            recipe_args={"num_samples": 256, "record_dir": str(record)},
            recipe=RECORDING,
        )
        outcome: dict = {}
        runner = threading.Thread(target=lambda: outcome.update(result=train_run(config)))
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
    assert result.units[1].origin == "memory"
    assert result.units[1].resumed_from.endswith("(in memory, its upload is in flight)")
    assert (result.epoch, result.samples_seen) == (3, 768)
    store = CheckpointStore(folder, "r", storage_options=s3[1])
    assert [i.name for i in store.list()] == [u.checkpoint_name for u in result.units]
    assert all(store.check(i, deep=True) == [] for i in store.list())


def test_the_retry_of_a_last_unit_whose_upload_was_refused_commits_it_as_recorded_and_trains_nothing(
    s3, moto_server, make_config, train_run, no_library_retries
):
    """The last unit's checkpoint reached this machine's memory and its upload was refused, so the unit failed waiting
    for it. Its retry in the same process (a Prefect task retry) commits that checkpoint from memory as it was recorded
    and trains nothing. Before, the retry resumed from memory at the run's end, trained a unit of 0 steps and committed
    the checkpoint again as 0 samples, a train_loss of 0 and no evaluation."""
    from training.run import Run, execute_unit
    from training.sweep.study import TIMINGS

    def figures(c) -> list[dict]:
        infos = CheckpointStore(c.save_folder, c.run_name, storage_options=c.storage_options).list()
        return [{k: v for k, v in i.metrics.items() if k not in TIMINGS} for i in infos]

    units = dict(max_duration="2ep", save_interval="1ep", eval_each_unit=True)
    reference = make_config(run_name="reference", **units)
    train_run(reference)
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        config = make_config(
            save_folder=folder, storage_options=through(proxy, **no_library_retries), store_retry_max_seconds=1, **units
        )
        proxy.deny = re.compile(r"PUT .*/checkpoints/ep2-ba16-sa512/state\.pt")
        with Run.open(config) as run:
            execute_unit(config, unit=0, generation=run.generation)
            with pytest.raises(AccessDeniedError):
                execute_unit(config, unit=1, generation=run.generation)
            assert CheckpointStore(folder, "r", storage_options=s3[1]).latest().name == "ep1-ba8-sa256"
            proxy.deny = None
            retried = execute_unit(config, unit=1, attempt=2, generation=run.generation)
        assert (retried.steps, retried.complete, retried.checkpoint_name) == (0, True, "ep2-ba16-sa512")
        assert retried.metrics["samples"] == 256.0 and "eval_accuracy" in retried.metrics
        assert figures(config) == figures(reference)  # both units' own figures, the second one's from memory
        store = CheckpointStore(folder, "r", storage_options=s3[1])
        assert all(store.check(i, deep=True) == [] for i in store.list())


@pytest.mark.slow
def test_a_kill_during_an_upload_leaves_latest_on_the_previous_verified_checkpoint(
    s3, moto_server, prefect_env, tmp_path
):
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    folder, options = s3
    args = [
        "--run_name",
        "k",
        "--recipe",
        "recipes.synthetic:SyntheticRecipe",
        "--max_duration",
        "3ep",
        "--global_batch_size",
        "32",
        "--seed",
        "7",
        "--unit_retries",
        "0",
        "--async_upload",
        "true",
    ]
    env = {
        **prefect_env,
        **{k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")},
    }

    def launch(save_folder: str, endpoint: str, log: str) -> subprocess.Popen:
        child_env = {**env, "TRAIN_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}})}
        return subprocess.Popen(
            [sys.executable, "-m", "flows.train", "--save_folder", save_folder, *args],
            cwd=ROOT,
            env=child_env,
            stdout=open(tmp_path / log, "w"),
            stderr=subprocess.STDOUT,
        )

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
        # nor its checkpoint agent's commit of the newest snapshot (checkpointing/commit/agent.py), refused here
        agent = wait_until(
            lambda: re.search(r"checkpoint agent: .* without closing its run.*", (tmp_path / "victim.log").read_text()),
            120,
            "the checkpoint agent's report",
        )
        assert "could not be committed" in agent.group(0) and "access denied" in agent.group(0), agent.group(0)

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


def test_our_retry_policy_is_the_only_retry_layer_for_s3_calls(s3, moto_server, caplog):
    """No `no_library_retries` here: the product itself turns s3fs's and botocore's retries off, so that
    store_retry_attempts / store_retry_max_seconds bound a call (5 x 5 x 6 = 150 requests before the fix)."""
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        # max_seconds=0: the budget is spent at once, so the floor of 3 attempts is the whole policy
        storage = Storage(folder, through(proxy), RetrySettings(attempts=3, max_seconds=0, initial_wait=0.01))
        storage.put("obj", b"payload")
        proxy.forget()
        proxy.script(PATTERN["get"], *[TRANSIENT["503 SlowDown"]] * 5)
        with caplog.at_level(logging.WARNING, logger=RETRY_LOG), pytest.raises(StorageError, match="retries exhausted"):
            storage.get("obj")
        assert proxy.seen(PATTERN["get"]) == [503, 503, 503]  # exactly our 3 attempts, one request each
        assert len(our_retries(caplog)) == 2
