"""Real torchrun, real gloo, real SIGKILL of a rank: world-size changes stay sample-exact."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from flows.train import train
from tests import deadlines
from tests.conftest import RECORDING
from tests.procs import this_worker

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def steps_by_rank(folder: Path, world_size: int) -> list[set[int]]:
    """Per global step, the ids all ranks trained on (line i of every rank's record is step i)."""
    ranks = [(folder / f"ids-rank{r}.txt").read_text().split("\n")[:-1] for r in range(world_size)]
    assert len({len(lines) for lines in ranks}) == 1, "ranks took different numbers of steps"
    return [set().union(*({int(i) for i in lines[s].split()} for lines in ranks)) for s in range(len(ranks[0]))]


def test_two_gloo_processes_complete_the_run_with_the_expected_counters(make_config, tmp_path, monkeypatch):
    config = make_config(nproc_per_node=2, max_duration="2ep", num_workers=2, recipe_args={"num_samples": 250})
    scratch = tmp_path / "tmp"  # the machine's temporary folder, for this process and every one it starts
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    result = train(config)

    # the gang's folder is gone, and torchrun's logs with it: left to itself, torchrun leaves a torchelastic_* folder
    # in the temporary folder at every launch; and each rank's and loader worker's pymp-* folder, which a process that
    # leaves without its exit handlers leaves (torchinductor_<user>: torch's compile cache, one per user, kept on purpose)
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []

    assert (result.epoch, result.step, result.samples_seen) == (2, 16, 500)
    assert all(u.world_size == 2 for u in result.units)
    latest = CheckpointStore(config.save_folder, config.run_name).latest()
    assert latest.manifest.metadata["world_size"] == 2
    assert {"rng-rank0.pt", "rng-rank1.pt", "state.pt"} <= set(latest.manifest.files)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_then_one_then_two_processes_see_every_sample_once_per_epoch(make_config, tmp_path, parallelism):
    n, record = 225, tmp_path / "ids"  # 225 = 7 x 32 + 1: an epoch ends with a one-sample batch
    args = {"num_samples": n, "record_dir": str(record)}
    plan = [
        (2, 32, "5ba", "5ba"),  # 160 samples on 2 ranks, stop mid-epoch
        (1, 16, "14ba", "2ba"),  # same per-rank batch on 1 rank: resumes at step 160 // 16 = 10
        (2, 32, "2ep", "1ep"),
    ]  # back to 2 ranks: resumes at step 224 // 32 = 7, then a 1-sample batch
    global_steps = []
    for segment, (nproc, gbs, duration, interval) in enumerate(plan):
        train(
            make_config(
                nproc_per_node=nproc,
                global_batch_size=gbs,
                max_duration=duration,
                save_interval=interval,
                recipe_args=args,
                recipe=RECORDING,
                parallelism=parallelism,
            )
        )
        global_steps += steps_by_rank(record, nproc)
        for f in record.glob("ids-rank*.txt"):
            f.rename(record / f"segment{segment}-{f.name}")

    seen = [i for step in global_steps for i in sorted(step)]
    assert len(seen) == 2 * n
    assert set(seen[:n]) == set(seen[n:]) == set(range(n))


def rank_processes(rank: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"training.distributed.rank" in cmdline
            and b"torch.distributed.run" not in cmdline
            and (rank is None or f"RANK={rank}".encode() in environ)
            and this_worker(environ)
        ):
            pids.append(int(pid))
    return pids


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_killing_one_rank_fails_the_unit_cleanly_and_the_retry_resumes(make_config, tmp_path, parallelism):
    record = tmp_path / "ids"
    config = make_config(
        parallelism=parallelism,
        nproc_per_node=2,
        max_duration="3ep",
        global_batch_size=16,
        recipe_args={"num_samples": 4000, "hidden": 256, "record_dir": str(record)},
        recipe=RECORDING,
    )
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(config)))
    runner.start()

    pointer = Path(config.save_folder, config.run_name, "latest")
    ids = record / "ids-rank1.txt"
    deadline = deadlines.deadline(240)
    while not pointer.exists():  # unit 0 trains and commits
        assert time.monotonic() < deadline and runner.is_alive(), "unit 0 never committed"
        time.sleep(0.02)
    lines_at_commit = 4000 // 16  # unit 0 is one epoch: one line per step
    assert len(ids.read_text().splitlines()) >= lines_at_commit
    gang = rank_processes(rank=1)  # the rank processes are kept across the units of an attempt
    while len(ids.read_text().splitlines()) <= lines_at_commit + 20:  # unit 1 has trained 20 steps
        assert time.monotonic() < deadline and runner.is_alive(), "unit 1 never started"
        time.sleep(0.02)
    victims = rank_processes(rank=1)
    assert len(victims) == 1 and victims == gang
    os.kill(victims[0], signal.SIGKILL)
    runner.join(timeout=300)

    result = outcome["result"]
    assert (result.epoch, result.samples_seen) == (3, 12000)
    assert [u.unit for u in result.units] == [0, 1, 2]
    assert result.units[1].resumed_from == f"checkpoint {result.units[0].checkpoint_name}"
    # the retry was for a crash of the killed rank, named with its signal, not for a preemption (a survivor that
    # torchrun stopped with SIGTERM is no evidence of one: training/distributed/deaths.py)
    assert result.units[1].previous_failure.startswith("RankDied: rank 1 died (SIGKILL, exit -9)"), result.units[1]
    assert json.loads(pointer.read_text())["name"] == result.units[-1].checkpoint_name
    assert rank_processes(rank=None) == []  # no orphan ranks left behind
    # The killed attempt trained part of unit 1; the retry trained unit 1 again from its checkpoint, so unit 1's
    # first batch (the first line after unit 0's) appears exactly twice.
    lines = ids.read_text().splitlines()
    first_of_unit1 = lines[lines_at_commit]
    assert lines.count(first_of_unit1) == 2
    assert len(lines) > 3 * 250
    latest = CheckpointStore(config.save_folder, config.run_name).latest()
    assert latest.manifest.metadata.get("parallelism", "ddp") == parallelism
    if parallelism == "fsdp":  # every rank wrote its own shards and RNG state; no gathered state.pt
        assert "state.pt" not in latest.manifest.files
        assert {"extra-rank0.pt", "extra-rank1.pt", ".metadata"} <= set(latest.manifest.files)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_accumulation_on_two_processes_makes_the_single_process_update(make_config, parallelism):
    """2 gloo processes x 2 micro-batches (DDP sync on the last only, each micro-batch weighted by its share)
    against 1 process taking the whole batch: the same weights up to float rounding. 250 samples: the last
    batch of 26 gives shares of 13 and micro-batches of 6 and 7."""
    from checkpointing.commit import sharded
    from checkpointing.store import STATE_FILE

    args = {"num_samples": 250, "dropout": 0.0}
    one = make_config(run_name="one", max_duration="1ep", recipe_args=args, grad_clip_norm=0.5)
    two = one.model_copy(
        update={"run_name": "two", "nproc_per_node": 2, "grad_accumulation": 2, "parallelism": parallelism}
    )
    states = []
    for config in (one, two):
        train(config)
        store = CheckpointStore(config.save_folder, config.run_name)
        info = store.latest()
        if sharded.is_sharded(info):
            states.append(sharded.consolidated_model(store, info))
        else:
            states.append(store.load(info.name, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"])
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=1e-5, atol=1e-6, msg=key)
