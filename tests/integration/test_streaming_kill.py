"""Token shards in a bucket (moto's S3 over HTTP), trained by the GPT recipe's streaming mode in real processes that are
really SIGKILLed (the whole process group: every rank) at random steps and relaunched with the same command, while the
world size goes 2 -> 1 -> 2 and the global batch size 32 -> 48 -> 16 between segments: training is fed every sample
exactly once per epoch, as an uninterrupted run is, read back from the data itself."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, SHARD_RECORDING, deadline, seeds
from tests.shard_data import BLOCK, SAMPLES, write_token_shards
from tests.unit.test_sharded_data import consumed, fed_batches, keep_records
from training.data import ShardedDataset

pytestmark = pytest.mark.slow
N = sum(SAMPLES)
# (processes, global batch size, where the segment ends): 160 samples, then to 400 (5 steps of 48), then 2 epochs.
SEGMENTS = [(2, 32, "160sp"), (1, 48, "400sp"), (2, 16, "2ep")]


def command(folder: str, options: dict, url: str, record: Path, nproc: int, batch: int, duration: str) -> list[str]:
    args = {"data_url": url, "data_options": options, "vocab_size": 512, "block_size": BLOCK, "n_layer": 1,
            "n_head": 1, "n_embd": 8, "record_dir": str(record)}  # fmt: skip
    return [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "stream", "--save_folder", folder,
        "--storage_options", json.dumps(options), "--recipe", SHARD_RECORDING, "--recipe_args", json.dumps(args),
        "--nproc_per_node", str(nproc), "--global_batch_size", str(batch), "--max_duration", duration,
        "--save_interval", "3ba", "--snapshot_interval", "1ba", "--seed", "11",
    ]  # fmt: skip


def lines(record: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in record.glob("read-rank*.txt"))


def launch(cmd: list[str], log: Path, kill_after: int | None, record: Path) -> int:
    """Runs ``cmd`` to its end, or SIGKILLs its process group once ``kill_after`` steps' records exist; its exit code
    (``-SIGKILL`` when killed)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        end = deadline(300)
        while kill_after is not None and proc.poll() is None and time.monotonic() < end:
            if lines(record) >= kill_after:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        code = proc.wait(timeout=300)
    if kill_after is None or code == 0:
        assert code == 0, log.read_text()[-4000:]
    return code


@pytest.mark.parametrize("seed", seeds(1))
def test_kills_with_world_and_batch_size_changes_feed_every_sample_once_per_epoch(tmp_path, s3, seed):
    folder, options = s3
    url = f"{folder.rsplit('/', 1)[0]}/tokens"
    write_token_shards(url, options)
    rng = random.Random(seed)
    record, launches = tmp_path / "record", []
    for segment, (nproc, batch, duration) in enumerate(SEGMENTS):
        cmd = command(folder, options, url, record, nproc, batch, duration)
        # killed at a random step of the segment (counted in records: one per rank per step), then relaunched
        launch(cmd, tmp_path / f"s{segment}-killed.log", rng.randint(1, 4) * nproc, record)
        launches.append(keep_records(record, tmp_path / f"s{segment}-killed"))
        launch(cmd, tmp_path / f"s{segment}.log", None, record)
        launches.append(keep_records(record, tmp_path / f"s{segment}-relaunched"))

    fed = consumed(launches)
    assert len(fed) == 2 * N
    assert sorted(fed[:N]) == sorted(fed[N:]) == list(range(N))  # each sample exactly once per epoch
    # ... and in each epoch's own order: each step got the samples the epoch's windowed shuffle puts at its position
    data = ShardedDataset(url, "tokens", block_size=BLOCK, storage_options=options, vocab_size=512)
    orders = [data.epoch_order(seed=11, epoch=epoch) for epoch in (0, 1)]
    for position, ids in fed_batches(launches):
        epoch, at = divmod(position, N)
        assert ids == sorted(int(i) for i in orders[epoch][at : at + len(ids)]), position
