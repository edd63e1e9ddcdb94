"""MDS (as MDSWriter writes it) and WebDataset tars (as webdataset.ShardWriter writes them) trained by real processes
that are really SIGKILLed (the process group: every rank) at a random step three times, each relaunch with another
world size, global batch size and number of DataLoader workers (2 ranks x 32, no workers -> 1 x 48, 2 workers -> 2 x
16, 1 worker each -> 1 x 48): each sample is fed exactly once in the epoch, read back from the data itself, and
each step gets the samples the epoch's order puts at its data position, as an uninterrupted run would. One
scenario per format (MDS on S3 over HTTP, WebDataset on a local folder); tests/integration/test_streaming_kill.py runs
the longer one for token shards."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys

import pytest

from tests.format_data import BLOCK, MDS_FIXTURES, MDS_SAMPLES, write_wds
from tests.format_recipes import FORMAT_RECORDING, TokenColumn
from tests.integration.test_streaming_kill import launch
from tests.unit.test_data_formats import upload
from tests.unit.test_sharded_data import consumed, fed_batches, keep_records
from training.lifetimes import remove_orphaned_semaphores

pytestmark = pytest.mark.slow
N = MDS_SAMPLES
# (ranks, global batch size, DataLoader workers per rank, killed after 1 to this many steps, at random; None: runs to
# the end). At most 128 + 96 + 32 = 256 of the 276 samples before the last launch: every kill lands before the end.
LAUNCHES = [(2, 32, 0, 4), (1, 48, 2, 2), (2, 16, 1, 2), (1, 48, 0, None)]


def command(
    fmt: str, folder: str, options: dict | None, url: str, record, nproc: int, batch: int, until: str, workers: int = 0
) -> list:
    args = {"data_format": fmt, "data_url": url, "data_options": options or {}, "vocab_size": 512, "block_size": BLOCK,
            "n_layer": 1, "n_head": 1, "n_embd": 8, "record_dir": str(record)}  # fmt: skip
    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "fmt", "--save_folder", folder,
        "--storage_options", json.dumps(options or {}), "--recipe", FORMAT_RECORDING, "--recipe_args", json.dumps(args),
        "--nproc_per_node", str(nproc), "--global_batch_size", str(batch), "--max_duration", until,
        "--save_interval", "2ba", "--snapshot_interval", "1ba", "--seed", "11", "--num_workers", str(workers),
    ]  # fmt: skip


@pytest.fixture
def semaphores_of_killed_groups():
    """Removes the named semaphores this test's kills leave in /dev/shm (what the product's own sweep removes once they
    are old, training/lifetimes.py): the loaders' worker queues are made under the forkserver context, whose names stay
    until the resource tracker unlinks them, and a SIGKILL of the whole process group takes the tracker too (14 names
    a chain)."""
    yield
    remove_orphaned_semaphores(older_than=0)


@pytest.mark.usefixtures("semaphores_of_killed_groups")
@pytest.mark.parametrize("fmt,where,parallelism", [("mds", "s3", "ddp"), ("webdataset", "local", "fsdp")])
def test_three_kills_with_world_and_batch_size_changes_feed_every_sample_once(
    request, tmp_path, monkeypatch, fmt, where, parallelism
):
    monkeypatch.setenv("TRAIN_ALLOWED_RECIPES", f"{os.environ['TRAIN_ALLOWED_RECIPES']},{FORMAT_RECORDING}")
    if fmt == "mds":
        data = tmp_path / "source"
        shutil.copytree(MDS_FIXTURES / "zstd", data)
    else:
        write_wds(tmp_path / "source", N)
    if where == "s3":
        folder, options = request.getfixturevalue("s3")
        url = upload(tmp_path / "source", f"{folder.rsplit('/', 1)[0]}/data", options)
    else:
        folder, options, url = str(tmp_path / "runs"), None, str(tmp_path / "source")
    rng, record, launches, codes = random.Random(fmt), tmp_path / "record", [], []
    for n, (nproc, batch, workers, kill) in enumerate(LAUNCHES):
        cmd = [*command(fmt, folder, options, url, record, nproc, batch, "1ep", workers), "--parallelism", parallelism]
        # each launch but the last is killed at a random step (a record per rank per step), past a checkpoint or not
        kill_after = rng.randint(1, kill) * nproc if kill else None
        codes.append(launch(cmd, tmp_path / f"launch{n}.log", kill_after, record))
        launches.append(keep_records(record, tmp_path / f"launch{n}"))
    fed = consumed(launches)
    assert codes == [-signal.SIGKILL] * 3 + [0]  # three kills, each before the epoch's end, then the run completes
    assert [len(list(launch.glob("read-rank*.txt"))) for launch in launches[:3]] == [2, 1, 2]  # each killed mid-run
    assert sorted(fed) == list(range(N))  # each sample exactly once in the epoch, across the kills and the changes
    # ... and in the epoch's own order: each step got the samples at its data position in the order an uninterrupted
    # run of any world and batch size walks (the dataset's windowed shuffle for seed 11, epoch 0)
    order = TokenColumn(str(tmp_path / "source"), fmt).epoch_order(seed=11, epoch=0)
    for position, ids in fed_batches(launches):
        assert ids == sorted(int(i) for i in order[position : position + len(ids)]), position
