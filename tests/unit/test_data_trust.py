"""What a run's data readers trust (issue 43, items 1, 2, 3 and 9): a deployment run's data lies under the worker's
roots and is read with the worker's storage options; a shard is the content its index fingerprinted; a declared
sample count is one the shard's size allows.

Through the real door where it is affordable: ``Run.open(untrusted=True)`` (what a deployment run opens) with
``TRAIN_ALLOWED_ROOTS=<local>,s3://team/runs`` against moto's S3 server holding two buckets, whose own request log
shows that nothing reached the other team's bucket; an HTTP listener that records every connection stands for the
endpoint a run's parameter names. The rest through ``ShardedDataset`` and the Prefect-free lifecycle."""

from __future__ import annotations

import json
import logging
import os
import tracemalloc
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest

from checkpointing.io import confine
from tests.integration.test_parameter_keys import Listener
from tests.shard_data import BLOCK, write_token_shards
from training import process_state
from training.config import ConfigError
from training.data import INDEX_FILE, ShardedDataset
from training.exceptions import DataError
from training.run import Run, TrainResult, execute_unit

OUTSIDE = "is outside the locations this worker allows (TRAIN_ALLOWED_ROOTS="
OPTIONS_LINE = "a deployment run's parameters cannot choose storage options"


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 600, text
    return text


def gpt_config(make_config, url: str, **overrides):
    args = {"data_url": url, "vocab_size": 512, "block_size": BLOCK, "n_layer": 1, "n_head": 1, "n_embd": 8}
    args.update(overrides.pop("recipe_args", {}))
    values = {"recipe": "recipes.gpt:GPTRecipe", "recipe_args": args, "max_duration": "1ep", "save_interval": "1ep"}
    return make_config(**{**values, **overrides})


def deployment_run(config) -> TrainResult:
    """The lifecycle of tests/lifecycle.py, opened as a deployment run opens (untrusted parameters)."""
    with Run.open(config, untrusted=True) as run:
        while not run.complete:
            run.record(execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation))
        return run.finish(run.final_metrics() or {})


class MotoLog:
    """moto's own request recorder, on for this test: every request the server received, as 'METHOD /path?query'."""

    def __init__(self, path: Path):
        from moto.moto_api import recorder

        self.recorder, self.path = recorder, path
        self.saved = (recorder._location, recorder._user_enabled)

    def start(self) -> None:
        self.path.write_text("")
        self.recorder._location, self.recorder._user_enabled = str(self.path), True

    def to(self, bucket: str) -> list[str]:
        requests = [json.loads(line) for line in self.path.read_text().splitlines()]
        found = [f"{r['method']} {urlsplit(r['url']).path}?{urlsplit(r['url']).query}" for r in requests]
        return [r for r in found if r.split(" ", 1)[1].split("?")[0].split("/")[1] == bucket]

    def stop(self) -> None:
        self.recorder._location, self.recorder._user_enabled = self.saved


@pytest.fixture
def moto_log(tmp_path):
    log = MotoLog(tmp_path / "moto-requests.jsonl")
    yield log
    log.stop()


@pytest.fixture
def two_buckets(moto_server, tmp_path, monkeypatch):
    """moto holding the worker's team bucket and another team's, both with token shards; the worker allows
    ``<tmp>/allowed`` and ``s3://team/runs``, and its environment gives the data's storage options."""
    import s3fs

    from deployments.local_s3 import LocalS3

    server = LocalS3(moto_server)
    server.fresh_bucket("team")
    server.make_bucket("other")
    options = server.storage_options
    write_token_shards("s3://other/tokens", options)
    write_token_shards("s3://team/runs/data", options)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    monkeypatch.setenv("TRAIN_ALLOWED_ROOTS", f"{allowed},s3://team/runs")
    monkeypatch.setenv("TRAIN_DATA_STORAGE_OPTIONS", json.dumps(options))
    monkeypatch.setenv("TRAIN_DATA_CACHE_DIR", str(tmp_path / "cache"))
    yield allowed, s3fs.S3FileSystem(**options, skip_instance_cache=True)
    s3fs.S3FileSystem.clear_instance_cache()
    while confine.roots() is not None:
        confine.leave()


# -- 1. a deployment run's data lies under the worker's roots ---------------------------------------------------------
def test_a_data_url_outside_the_roots_is_refused_before_any_request_reaches_the_other_bucket(
    two_buckets, moto_log, make_config, tmp_path
):
    allowed, fs = two_buckets
    refused = {
        "data_url": "s3://other/tokens",
        "val_url": "s3://other/tokens",
        "data_url.dots": "s3://team/runs/../../other/tokens",
    }
    moto_log.start()
    for case, url in refused.items():
        option = case.split(".")[0]
        args = {"data_url": "s3://team/runs/data", option: url}
        config = gpt_config(make_config, args["data_url"], save_folder=str(allowed / "runs"), recipe_args=args)
        with pytest.raises(ConfigError) as info:
            deployment_run(config)
        assert one_line(info.value).startswith(f"recipe_args.{option}={url!r} {OUTSIDE}{allowed},s3://team/runs)")
    assert moto_log.to("other") == []  # not one request: no listing, no read, no index written
    assert not (tmp_path / "cache").exists()  # nothing cached
    assert not (allowed / "runs").exists()  # nothing claimed

    # The door is open: data under a root trains, read with the worker's TRAIN_DATA_STORAGE_OPTIONS.
    config = gpt_config(make_config, "s3://team/runs/data", save_folder=str(allowed / "runs"))
    assert deployment_run(config).samples_seen == 276
    assert moto_log.to("other") == [] and moto_log.to("team")
    assert fs.exists("team/runs/data/" + INDEX_FILE) and not fs.exists("other/tokens/" + INDEX_FILE)


def test_a_url_a_recipe_builds_itself_is_checked_by_the_reader_in_the_run_and_in_its_rank_processes(
    two_buckets, moto_log, monkeypatch
):
    allowed, _ = two_buckets
    moto_log.start()
    for how in ("in the run's process", "in a rank process"):
        if how == "in the run's process":
            confine.enter([str(allowed), "s3://team/runs"])
        else:  # what training/distributed/gang.py hands its ranks
            monkeypatch.setenv(confine.ROOTS_ENV, json.dumps([str(allowed), "s3://team/runs"]))
        for url in (
            "s3://other/tokens",
            "s3://team/runs-other/x",
            "s3://team//runs/data",
            "simplecache::s3://team/runs",
        ):
            with pytest.raises(ConfigError) as info:
                ShardedDataset(url, "tokens", block_size=BLOCK)
            assert one_line(info.value).startswith(f"ShardedDataset url={url!r} {OUTSIDE}"), how
        with pytest.raises(ConfigError) as info:  # a recipe's own options: never in a confined run
            ShardedDataset("s3://team/runs/data", "tokens", block_size=BLOCK, storage_options={"profile": "theirs"})
        assert one_line(info.value).startswith(f"ShardedDataset storage_options.profile: {OPTIONS_LINE}")
        assert len(ShardedDataset("s3://team/runs/data", "tokens", block_size=BLOCK)) == 276, how
        confine.leave()
        monkeypatch.delenv(confine.ROOTS_ENV, raising=False)
    assert confine.local_roots() is None and moto_log.to("other") == []


# -- 2. storage options for data come from the worker's environment ---------------------------------------------------
@pytest.fixture
def listener():
    running = Listener()
    yield running
    running.close()


def test_data_options_naming_an_endpoint_are_refused_and_the_endpoint_hears_nothing(two_buckets, listener, make_config):
    allowed, _ = two_buckets
    attacks = {
        "endpoint_url": {"endpoint_url": listener.url},
        "client_kwargs": {"client_kwargs": {"endpoint_url": listener.url}},
        "profile": {"profile": "creators-profile"},
        "config_kwargs": {"config_kwargs": {"proxies": {"http": listener.url, "https": listener.url}}},
    }
    for key, options in attacks.items():
        args = {"data_url": "s3://team/runs/data", "data_options": options}
        config = gpt_config(make_config, args["data_url"], save_folder=str(allowed / "runs"), recipe_args=args)
        with pytest.raises(ConfigError) as info:
            deployment_run(config)
        text = one_line(info.value)
        assert (
            text.startswith(f"recipe_args.data_options.{key}: {OPTIONS_LINE}") and "TRAIN_DATA_STORAGE_OPTIONS" in text
        )
    assert listener.seen == []
    assert not (allowed / "runs").exists()

    # A person's own run (python -m flows.train, train() from Python) keeps them: the same options reach the endpoint.
    args = {"data_url": "s3://team/runs/data", "data_options": attacks["endpoint_url"]}
    with pytest.raises(ConfigError, match=r"403|Forbidden|AccessDenied"):  # the listener answers 403
        Run.open(gpt_config(make_config, args["data_url"], recipe_args=args, store_retry_attempts=1))
    assert listener.seen


# -- 3. a shard is the content its index fingerprinted ----------------------------------------------------------------
def rewrite_same_size(data: bytes) -> bytes:
    """Other tokens, every one inside the vocabulary, in as many bytes."""
    return np.full(len(data) // 2, 7, dtype=np.uint16).tobytes()


def test_a_local_shard_rewritten_with_other_bytes_of_the_same_size_stops_the_relaunch_in_one_line(
    tmp_path, make_config, train_run
):
    url = str(tmp_path / "tokens")
    write_token_shards(url)
    assert train_run(gpt_config(make_config, url)).samples_seen == 276
    index = json.loads(Path(url, INDEX_FILE).read_text())
    assert all(row[3].startswith("sha256:") for row in index["shards"])
    shard = Path(url, "shard-002.bin")
    shard.write_bytes(rewrite_same_size(shard.read_bytes()))
    process_state.reset()  # the relaunch is a process of its own (this one keeps its readers warm for the next unit)
    with pytest.raises(DataError) as info:
        train_run(gpt_config(make_config, url, max_duration="2ep"))
    text = one_line(info.value)
    assert text.startswith(f"{shard}: its sha256 is ") and f"the index {url}/{INDEX_FILE} recorded sha256:" in text
    assert text.endswith("the shard was rewritten with other content; restore it as it was, or delete the index and "
                         "start a new run_name")  # fmt: skip


def test_a_shard_in_a_bucket_rewritten_with_other_bytes_of_the_same_size_stops_the_run_in_one_line(s3, tmp_path):
    import s3fs

    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    cache = str(tmp_path / "cache")
    ds = ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=cache)
    assert all(s.fingerprint.startswith("etag:") for s in ds.index.shards)
    key = f"{url[5:]}/shard-001.bin"
    fs.pipe_file(key, rewrite_same_size(fs.cat_file(key)))  # after the run opened the index, before it read the shard
    with pytest.raises(DataError) as info:
        ds[40]
    text = one_line(info.value)
    assert (
        text.startswith(f"{url}/shard-001.bin: its ETag is ") and "the shard was rewritten with other content" in text
    )
    assert not [p for p in Path(cache).rglob("shard-001.bin*")]  # not one byte of it kept in the cache
    with pytest.raises(DataError) as info:  # the next launch: the listing says so before anything is read
        ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=cache)
    assert one_line(info.value).startswith(f"{url}/shard-001.bin: its ETag is ")


def test_a_copy_cached_under_an_older_index_is_never_taken_for_a_shard_of_the_same_size(s3, tmp_path):
    import s3fs

    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    cache = str(tmp_path / "cache")
    assert ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=cache)[40][0][0] == 40
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    key = f"{url[5:]}/shard-001.bin"
    fs.pipe_file(key, rewrite_same_size(fs.cat_file(key)))
    fs.rm(f"{url[5:]}/{INDEX_FILE}")  # the owner rebuilt the index for the new data (a new run)
    ds = ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=cache)
    assert ds[40][0][0] == 7  # the new bytes, not the cached copy of the old ones


def test_an_index_without_fingerprints_keeps_working_with_one_warning(tmp_path, caplog):
    url = str(tmp_path / "tokens")
    write_token_shards(url)
    ds = ShardedDataset(url, "tokens", block_size=BLOCK)
    old = {"format": 1, "kind": "tokens", "params": ds.index.params, "shards": [[s.name, s.size, s.samples]
                                                                                for s in ds.index.shards]}  # fmt: skip
    Path(url, INDEX_FILE).write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING, logger="training.data.index"):
        again = ShardedDataset(url, "tokens", block_size=BLOCK)
    assert again[40][0][0] == 40 and json.loads(again.index.to_json()) == old  # a run's recorded index is unchanged
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{url}/{INDEX_FILE} has no content fingerprints (written before them): a shard rewritten with other bytes of "
        f"the same size would not be noticed; delete it before a new run to have it rebuilt with them"
    ]
    for bad in ["md5:abc", "sha256:XYZ", 7]:
        index = json.loads(ds.index.to_json())
        index["shards"][0][3] = bad
        Path(url, INDEX_FILE).write_text(json.dumps(index))
        with pytest.raises(DataError, match=r"a shard entry is not \[name, bytes, samples, fingerprint\]; delete it"):
            ShardedDataset(url, "tokens", block_size=BLOCK)


# -- 9. a declared sample count is one the shard's size allows --------------------------------------------------------
@pytest.mark.parametrize("declared", [2**30, 2**40])
def test_a_forged_sample_count_is_one_line_naming_shard_and_index_with_no_big_allocation(tmp_path, declared):
    url = str(tmp_path / "tokens")
    write_token_shards(url, samples=(40,))
    ShardedDataset(url, "tokens", block_size=BLOCK)
    index = json.loads(Path(url, INDEX_FILE).read_text())
    index["shards"][0][2] = declared
    Path(url, INDEX_FILE).write_text(json.dumps(index))
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            ds = ShardedDataset(url, "tokens", block_size=BLOCK)
            ds.epoch_order(seed=1, epoch=0)[0:32]  # what the sampler asks for first
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert one_line(info.value) == (
        f"{url}/shard-000.bin is {os.path.getsize(Path(url, 'shard-000.bin'))} bytes, room for at most 40 samples, but "
        f"the index {url}/{INDEX_FILE} declares {declared}: the index is damaged or forged; delete it to have it rebuilt"
    )
    assert peak < 64 << 20  # (reading the index takes a 16 MiB buffer; 2**30 sample ids would take 8 GiB)


def test_a_jsonl_count_above_what_its_bytes_hold_is_refused(tmp_path):
    folder = tmp_path / "lines"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(f'{{"i": {i}}}\n' for i in range(10)))
    ShardedDataset(str(folder), "jsonl")
    index = json.loads((folder / INDEX_FILE).read_text())
    index["shards"][0][2] = 10_000
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"a\.jsonl is 90 bytes, room for at most 45 samples, but the index .* 10000"):
        ShardedDataset(str(folder), "jsonl")


@pytest.mark.slow
def test_the_rank_processes_of_a_deployment_run_read_its_data_under_the_object_store_roots(
    two_buckets, moto_log, make_config
):
    """The ranks inherit the roots in force, the object-store ones too (training/distributed/gang.py): with only the
    local ones they refused the allowed bucket; with none they would read any."""
    allowed, _ = two_buckets
    moto_log.start()
    config = gpt_config(make_config, "s3://team/runs/data", save_folder=str(allowed / "runs"), nproc_per_node=2)
    assert deployment_run(config).samples_seen == 276
    assert moto_log.to("other") == []


def test_a_bucket_copied_to_a_local_folder_with_its_index_is_checked_against_the_etags(s3, tmp_path):
    import s3fs

    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=str(tmp_path / "cache"))
    local = tmp_path / "copy"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).get(f"{url[5:]}/", f"{local}/", recursive=True)
    assert ShardedDataset(str(local), "tokens", block_size=BLOCK)[40][0][0] == 40  # a plain ETag is the bytes' MD5
    shard = local / "shard-001.bin"
    shard.write_bytes(rewrite_same_size(shard.read_bytes()))
    with pytest.raises(DataError) as info:
        ShardedDataset(str(local), "tokens", block_size=BLOCK)[40]
    assert one_line(info.value).startswith(f"{shard}: its MD5 is ")
