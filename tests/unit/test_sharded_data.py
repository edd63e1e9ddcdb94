"""Streaming shards (training/data/): the index, the three formats as their real writers write them, the order, the
cache, hostile data, and a run over them through the lifecycle (Prefect-free)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, SHARD_RECORDING
from tests.shard_data import BLOCK, SAMPLES, write_token_shards
from training.config import ConfigError
from training.data import INDEX_FILE, ShardedDataset, WindowedOrder
from training.exceptions import DataError
from training.position.sampler import ResumableBatchSampler

N = sum(SAMPLES)


@pytest.fixture
def tokens(tmp_path) -> str:
    url = str(tmp_path / "tokens")
    write_token_shards(url)
    return url


def gpt_args(url: str, record_dir, **extra) -> dict:
    return {
        "data_url": url,
        "vocab_size": 512,
        "block_size": BLOCK,
        "n_layer": 1,
        "n_head": 1,
        "n_embd": 8,
        "record_dir": str(record_dir),
        **extra,
    }


def consumed(record_dirs) -> list[int]:
    """The ids training was fed, in the order of the run's data position, from one record folder per launch: a later
    launch's records replace an earlier one's from the position where it resumed (what a killed launch trained past
    its last checkpoint is trained again). Within one step (a global batch) sorted."""
    return [i for _, ids in fed_batches(record_dirs) for i in ids]


def fed_batches(record_dirs) -> list[tuple[int, list[int]]]:
    """(data position, the global batch's ids, sorted) of each step training was fed, as ``consumed`` reads them."""
    history: dict[int, list[int]] = {}
    for folder in record_dirs:
        launch: dict[int, list[int]] = {}
        for path in sorted(folder.glob("read-rank*.txt")) if folder.exists() else []:
            for line in path.read_text().splitlines():
                position, *ids = map(int, line.split())
                launch.setdefault(position, []).extend(ids)
        if launch:
            history = {p: ids for p, ids in history.items() if p < min(launch)} | launch
    ordered, expected = [], 0
    for position in sorted(history):
        assert position == expected, f"a gap or overlap in the data position at {position} (expected {expected})"
        ordered.append((position, sorted(history[position])))
        expected += len(history[position])
    return ordered


# -- the formats, as their own libraries write them ------------------------------------------------------------------
def test_token_shards_are_addressed_by_one_global_id_and_the_index_is_written_beside_them(tokens):
    ds = ShardedDataset(tokens, "tokens", block_size=BLOCK)
    assert len(ds) == N
    for g in (0, 36, 37, 86, N - 1):
        x, y = ds[g]
        assert x.dtype == torch.int64 and x.tolist() == [g] * BLOCK and y[:-1].tolist() == [g] * (BLOCK - 1)
    batch = ds.__getitems__([86, 0, 37, 36, 87])  # what a DataLoader asks for: read per shard, in the order asked
    assert [x[0].item() for x, _ in batch] == [86, 0, 37, 36, 87]
    assert all(
        torch.equal(a, ds[i][0]) and torch.equal(b, ds[i][1])
        for (a, b), i in zip(batch, [86, 0, 37, 36, 87], strict=True)
    )
    index = json.loads(Path(tokens, INDEX_FILE).read_text())
    assert [row[2] for row in index["shards"]] == list(SAMPLES)
    assert ShardedDataset(tokens, "tokens", block_size=BLOCK).index == ds.index  # read back, not rebuilt


def test_npy_token_shards_as_numpy_saves_them(tmp_path):
    folder = tmp_path / "npy"
    folder.mkdir()
    np.save(folder / "a.npy", np.arange(0, 17, dtype=np.int32))  # 17 tokens: 2 samples of 8 (+1 target)
    np.save(folder / "b.npy", np.arange(100, 125, dtype=np.uint16))  # 25 tokens: 3 samples
    ds = ShardedDataset(str(folder), "tokens", block_size=8)
    assert len(ds) == 5
    assert ds[1][0].tolist() == list(range(8, 16)) and ds[1][1].tolist() == list(range(9, 17))
    assert ds[4][0].tolist() == list(range(116, 124))


def test_jsonl_and_parquet_shards_written_by_their_libraries(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "j").mkdir()
    for j in range(3):
        lines = [json.dumps({"text": f"s{j}-{k}", "n": k}) for k in range(4 + j)]
        (tmp_path / "j" / f"part-{j}.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]))
    jsonl = ShardedDataset(str(tmp_path / "j"), "jsonl")
    assert len(jsonl) == 4 + 5 + 6  # the blank line is no sample; the last line has no newline
    assert jsonl[4] == {"text": "s1-0", "n": 0} and jsonl[14] == {"text": "s2-5", "n": 5}

    (tmp_path / "p").mkdir()
    for j in range(2):
        table = pa.table({"id": list(range(j * 10, j * 10 + 7)), "text": [f"r{i}" for i in range(7)]})
        pq.write_table(table, tmp_path / "p" / f"part-{j}.parquet", row_group_size=3)
    parquet = ShardedDataset(str(tmp_path / "p"), "parquet", columns=["id"])
    assert len(parquet) == 14
    assert [parquet[i]["id"] for i in range(14)] == [*range(7), *range(10, 17)]
    assert [row["id"] for row in parquet.__getitems__([13, 0, 7, 2])] == [16, 0, 10, 2]  # a batch, in the order asked


def test_a_bucket_is_read_through_a_bounded_cache(s3, tmp_path):
    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    cache = tmp_path / "cache"
    shard_bytes = (max(SAMPLES) * BLOCK + 1) * 2
    ds = ShardedDataset(
        url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=str(cache), cache_bytes=1 << 20
    )
    ds.cache_bytes = 2 * shard_bytes  # below the 1 MiB the option allows: two shards' worth, to see eviction
    for g in range(N):
        assert ds[g][0][0].item() == g
        held = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        assert held <= 2 * shard_bytes
    assert len([f for f in cache.rglob("*.bin")]) <= 2


def test_the_sampler_reaching_a_window_reads_its_shards_and_the_next_windows_ahead(s3, tmp_path):
    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    cache = tmp_path / "cache"
    ds = ShardedDataset(
        url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=str(cache), shuffle_window=2
    )
    order = ds.epoch_order(seed=1, epoch=0)
    order[0:1]  # what the sampler does as it starts the epoch
    for future in list(ds._fetching.values()):
        future.result(timeout=60)
    ahead = {f"shard-{int(j):03d}.bin" for g in order.groups[:2] for j in g}
    assert {f.name for f in cache.rglob("*.bin")} == ahead  # windows 0 and 1, nothing else, before any sample is read
    assert ds[int(order[0])][0][0].item() == int(order[0])


# -- the order -------------------------------------------------------------------------------------------------------
def test_the_epoch_order_is_a_permutation_found_by_arithmetic_not_by_reading_what_came_before():
    order = WindowedOrder(list(SAMPLES), seed=3, epoch=1, window=2)
    whole = order[:].tolist()
    assert sorted(whole) == list(range(N)) and whole != list(range(N))
    assert whole == WindowedOrder(list(SAMPLES), seed=3, epoch=1, window=2)[:].tolist()
    assert whole != WindowedOrder(list(SAMPLES), seed=3, epoch=2, window=2)[:].tolist()
    late = WindowedOrder(list(SAMPLES), seed=3, epoch=1, window=2)
    assert late[250:260].tolist() == whole[250:260] and int(late[N - 1]) == whole[-1]
    assert set(late._cache) == {2}  # only the last window was computed
    # a window holds whole shards: the ids of one window come from `window` shards only
    starts = np.cumsum([0, *SAMPLES])
    first_window = {int(np.searchsorted(starts, i, side="right")) - 1 for i in whole[: len(order.window(0))]}
    assert len(first_window) == 2


def test_batch_and_world_size_changes_over_a_shard_order_repeat_and_drop_nothing(tokens):
    ds = ShardedDataset(tokens, "tokens", block_size=BLOCK, shuffle_window=2)
    seen, position = [], 0
    for world, batch, steps in [(2, 32, 3), (1, 48, 2), (2, 16, 100)]:
        sampler = ResumableBatchSampler(N, batch, seed=5, epoch=0, start=position, order=ds.epoch_order)
        for taken, (_, n) in enumerate(sampler.shares()):
            if taken == steps:
                break
            shares = [
                ResumableBatchSampler(
                    N, batch, seed=5, epoch=0, start=position, rank=r, world_size=world, order=ds.epoch_order
                )
                for r in range(world)
            ]
            seen += [i for s in shares for i in next(iter(s.shares()))[0]]
            position += n
    assert sorted(seen) == list(range(N))


# -- a run over shards, through the lifecycle ------------------------------------------------------------------------
def test_ten_resumes_in_a_row_feed_the_same_samples_in_the_same_order_as_none(make_config, train_run, tokens, tmp_path):
    common = dict(recipe=SHARD_RECORDING, global_batch_size=16, save_interval="2ba", snapshot_interval="1ba")
    record = tmp_path / "record"
    args = gpt_args(tokens, record)
    train_run(make_config(run_name="once", max_duration="2ep", recipe_args=args, **common))
    once = consumed([keep_records(record, tmp_path / "once")])
    steps_per_epoch = -(-N // 16)
    launches = []
    for k in range(1, 11):  # ten launches, each a few steps further: every one resumes from the one before
        stop = f"{min(2 * steps_per_epoch, 4 * k)}ba" if k < 10 else "2ep"
        train_run(make_config(run_name="resumed", max_duration=stop, recipe_args=args, **common))
        launches.append(keep_records(record, tmp_path / f"launch{k}"))
    assert consumed(launches) == once
    assert sorted(once[:N]) == sorted(once[N:]) == list(range(N))


def keep_records(record, folder):
    """Moves a launch's records into a folder of its own (recipe_args, and so the record folder, stay the same)."""
    folder.mkdir()
    for f in record.glob("read-rank*.txt"):
        f.rename(folder / f.name)
    return folder


def test_a_run_with_loader_workers_keeps_them_across_units(make_config, train_run, tmp_path):
    record = tmp_path / "pids"
    config = make_config(
        recipe="tests.recipes_for_tests:WorkerPidRecipe",
        recipe_args={"num_samples": 64, "record_dir": str(record)},
        max_duration="4ep",
        save_interval="1ep",
        num_workers=2,
    )
    result = train_run(config)
    assert len(result.units) == 4
    pids = set((record / "pids.txt").read_text().split())
    assert len(pids) == 2 and str(os.getpid()) not in pids  # two workers served all four units


# -- what is refused -------------------------------------------------------------------------------------------------
def test_a_stateless_iterable_dataset_is_refused_in_one_line_naming_the_sharded_way(make_config, train_run):
    # a stateful one trains, its state saved per rank: tests/unit/test_stateful_iterable.py
    config = make_config(recipe="tests.recipes_for_tests:StreamRecipe", recipe_args={"stateful": False})
    with pytest.raises(ConfigError) as caught:
        train_run(config)
    message = str(caught.value)
    assert "\n" not in message and "training.data.ShardedDataset(url, format)" in message
    assert "no len() and no state" in message
    assert not os.path.exists(os.path.join(config.save_folder, "r", "latest"))


def test_shards_that_changed_under_their_index_stop_the_run_with_one_line(tokens):
    ShardedDataset(tokens, "tokens", block_size=BLOCK)
    path = Path(tokens, "shard-002.bin")
    data = path.read_bytes()
    path.write_bytes(data[:-16])  # cut short
    with pytest.raises(DataError, match=r"shard shard-002.bin is \d+ bytes, the index says \d+: the data changed"):
        ShardedDataset(tokens, "tokens", block_size=BLOCK)
    os.unlink(path)
    with pytest.raises(DataError, match=r"shard shard-002\.bin is missing from the folder"):
        ShardedDataset(tokens, "tokens", block_size=BLOCK)
    path.write_bytes(data)
    Path(tokens, "shard-009.bin").write_bytes(data)
    with pytest.raises(DataError, match=r"1 shard\(s\) the index does not know \(shard-009.bin"):
        ShardedDataset(tokens, "tokens", block_size=BLOCK)
    with pytest.raises(DataError, match=r"indexes tokens shards with .* not tokens with"):
        ShardedDataset(tokens, "tokens", block_size=BLOCK * 2)


def test_a_shard_cut_short_after_the_run_opened_it_is_one_error_not_a_shifted_position(tokens):
    ds = ShardedDataset(tokens, "tokens", block_size=BLOCK)
    path = os.path.join(tokens, "shard-001.bin")
    os.truncate(path, os.path.getsize(path) - 64)
    with pytest.raises(DataError, match=r"shard-001.bin is \d+ bytes, the index says \d+"):
        ds[40]


def test_a_hostile_index_or_a_shard_behind_a_link_is_refused(tokens, tmp_path):
    for body in [b"{" * 100_000, b'{"format":1,"kind":"tokens","params":{},"shards":[["../x",1,1]]}', b"\xff"]:
        with open(os.path.join(tokens, INDEX_FILE), "wb") as f:
            f.write(body)
        with pytest.raises(DataError, match=rf"{INDEX_FILE}: .*delete it to have it rebuilt"):
            ShardedDataset(tokens, "tokens", block_size=BLOCK)
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(os.path.join(tokens, "shard-000.bin"), linked / "a.bin")
    with pytest.raises(DataError, match=r"a\.bin is a link or not a regular file"):
        ShardedDataset(str(linked), "tokens", block_size=BLOCK)


def test_a_corrupt_parquet_footer_is_one_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p").mkdir()
    path = tmp_path / "p" / "a.parquet"
    pq.write_table(pa.table({"x": list(range(10))}), path)
    data = path.read_bytes()
    path.write_bytes(data[:-12] + b"\0" * 8 + data[-4:])  # footer length and magic damaged
    with pytest.raises(DataError, match=r"a.parquet: not a Parquet file pyarrow reads"):
        ShardedDataset(str(tmp_path / "p"), "parquet")


# The peak is this process's own (VmHWM, the high-water mark of its memory since exec): getrusage's ru_maxrss keeps
# what the process was before exec, i.e. the pytest worker that forked it (1.08 GB once late in a full run).
MEASURE_LONG_LINE = """
import re, sys, time
from training.data import ShardedDataset
from training.exceptions import DataError
start = time.process_time()
try:
    ShardedDataset(sys.argv[1], "jsonl", max_sample_bytes=1 << 20)
    print("accepted")
except DataError as exc:
    peak_kib = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
    print(f"{exc}|{time.process_time() - start:.2f}|{peak_kib}")
"""


def test_a_10_gb_jsonl_line_is_one_error_in_bounded_memory_and_time(tmp_path):
    folder = tmp_path / "j"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"ok": 1}\n')
    with open(folder / "b.jsonl", "wb") as f:
        f.truncate(10 << 30)  # sparse: 10 GB with no newline, taking no disk
    proc = subprocess.run([sys.executable, "-c", MEASURE_LONG_LINE, str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    message, cpu, peak_kib = proc.stdout.strip().rsplit("|", 2)
    assert message.endswith("b.jsonl: line 1 is longer than max_sample_bytes=1048576; raise it, or split the line")
    assert float(cpu) < 5  # stopped after its first chunks, not after reading 10 GB
    assert int(peak_kib) < 1024 * 1024  # far below the line's size
    assert not (folder / INDEX_FILE).exists()  # nothing written


def test_bad_options_are_one_line_naming_the_option(tokens):
    with pytest.raises(ConfigError, match=r"format='csv': use one of tokens, jsonl, parquet"):
        ShardedDataset(tokens, "csv")
    with pytest.raises(ConfigError, match=r"block_size=None: token shards need"):
        ShardedDataset(tokens, "tokens")
    with pytest.raises(DataError, match=r"no jsonl shards there \(files ending .jsonl\)"):
        ShardedDataset(tokens, "jsonl")


def test_a_credential_in_the_gpt_recipes_data_options_is_refused():
    from recipes.gpt import GPTRecipe

    with pytest.raises(ValueError, match="'aws_secret_access_key' looks like a credential"):
        GPTRecipe(data_url="s3://b/t", data_options={"client_kwargs": {"aws_secret_access_key": "x"}})


def test_a_token_outside_the_vocabulary_is_one_error_naming_the_shard(tokens):
    ds = ShardedDataset(tokens, "tokens", block_size=BLOCK, vocab_size=101)
    assert ds[99][1][-1].item() == 100  # its targets end with the next sample's first token
    with pytest.raises(DataError, match=r"shard-002\.bin: sample 13 holds token 101, outside vocab_size=101"):
        ds[100]
    with pytest.raises(DataError, match=r"shard-002\.bin: sample 13 holds token 101, outside vocab_size=101"):
        ds.__getitems__([99, 100])


def test_a_cache_folder_another_user_planted_or_may_enter_is_never_adopted(s3, tmp_path):
    import pwd

    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    shared = tmp_path / "shared-cache"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    ds = ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=str(shared))
    with pytest.raises(DataError, match=r"shard cache: .*shared-cache belongs to uid \d+ with mode 777"):
        ds[0]
    if os.getuid() == 0:  # a folder another user made: root must not adopt it
        import shutil
        import tempfile

        parent = Path(tempfile.mkdtemp(dir="/tmp"))  # a shared folder like /tmp itself: anyone may make entries
        os.chmod(parent, 0o1777)
        planted = parent / "planted"
        subprocess.run(["runuser", "-u", "nobody", "--", "mkdir", "-m", "700", str(planted)], check=True)
        nobody = pwd.getpwnam("nobody").pw_uid
        assert planted.stat().st_uid == nobody
        ds = ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, cache_dir=str(planted))
        with pytest.raises(DataError, match=rf"planted belongs to uid {nobody}"):
            ds[0]
        assert list(planted.iterdir()) == []  # nothing written into it
        shutil.rmtree(parent)
