"""Exact resume through the run's lifecycle (``train_run``): sample-exact across batch-size changes and data-skip
options; and through the real flow, whose retry resumes mid-epoch with loader workers bit-identically."""

from __future__ import annotations

import os

import pytest
import torch

from checkpointing import CheckpointStore
from flows.train import train
from tests.conftest import RECORDING
from tests.procs import children, cmdline
from training.position.sampler import epoch_order

N = 240  # samples in the synthetic dataset


def recorded_ids(folder) -> list[int]:
    lines = (folder / "ids-rank0.txt").read_text().split("\n")
    return [int(i) for line in lines for i in line.split()]


def test_resizing_the_global_batch_mid_epoch_repeats_and_drops_no_sample(make_config, tmp_path, train_run):
    record = tmp_path / "ids"
    args = {"num_samples": N, "record_dir": str(record)}
    # 32 x 5 = 160 samples, stop mid-epoch. 48: resumes at step 160 // 48 = 3; steps 4-7 take 48, 32 (the
    # epoch's short last batch), 48, 48 -> 336 samples. 20: resumes at step 336 // 20 = 16; 144 samples
    # left in epoch 1 (7 batches + a short one of 4) and 12 batches in epoch 2 -> step 36, 720 samples.
    plan = [(32, "5ba"), (48, "7ba"), (20, "3ep")]
    results = [
        train_run(
            make_config(
                global_batch_size=gbs, max_duration=dur, save_interval="2ba", recipe_args=args, recipe=RECORDING
            )
        )
        for gbs, dur in plan
    ]

    assert [(r.step, r.samples_seen) for r in results] == [(5, 160), (7, 336), (36, 720)]
    seen = recorded_ids(record)
    assert len(seen) == 3 * N
    for epoch in range(3):
        assert sorted(seen[epoch * N : (epoch + 1) * N]) == list(range(N)), f"epoch {epoch}"
        assert seen[epoch * N : (epoch + 1) * N] == epoch_order(N, 7, epoch).tolist()


def test_ignore_data_skip_restarts_the_epoch_once(make_config, tmp_path, train_run):
    record = tmp_path / "ids"
    args = {"num_samples": N, "record_dir": str(record)}
    train_run(
        make_config(max_duration="5ba", save_interval="5ba", recipe_args=args, recipe=RECORDING)
    )  # stops at sample 160
    (record / "ids-rank0.txt").unlink()
    train_run(
        make_config(max_duration="1ep", save_interval="2ba", ignore_data_skip=True, recipe_args=args, recipe=RECORDING)
    )

    # The epoch's data restarts from its first sample (once: later units of the run continue normally).
    assert recorded_ids(record) == epoch_order(N, 7, 0).tolist()


def test_data_skip_steps_skips_batches_of_the_new_size_from_the_epoch_start(make_config, tmp_path, train_run):
    record = tmp_path / "ids"
    args = {"num_samples": N, "record_dir": str(record)}
    train_run(make_config(max_duration="5ba", save_interval="5ba", recipe_args=args, recipe=RECORDING))
    (record / "ids-rank0.txt").unlink()
    train_run(
        make_config(
            global_batch_size=48,
            max_duration="1ep",
            save_interval="1ba",
            data_skip_steps=2,
            recipe_args=args,
            recipe=RECORDING,
        )
    )

    assert recorded_ids(record) == epoch_order(N, 7, 0).tolist()[2 * 48 :]


@pytest.mark.slow  # a Prefect test server, and loader worker processes for every epoch of two runs
@pytest.mark.usefixtures("prefect_harness")
def test_mid_epoch_resume_with_loader_workers_is_bit_identical(make_config):
    common = dict(max_duration="2ep", save_interval="3ba", num_workers=2, recipe_args={"num_samples": N})
    clean = train(make_config(run_name="clean", **common))
    # the run's loader workers ended with it, the ordinary way (killed at this process's exit instead, each left its
    # /tmp/pymp-* folder); the forkserver that started them stays, as multiprocessing keeps it
    forkservers = [p for p in children(os.getpid()) if b"multiprocessing.forkserver" in cmdline(p)]
    assert len(forkservers) == 1 and children(forkservers[0]) == []
    faulty = train(make_config(run_name="faulty", inject_fault_at_step=10, **common))

    assert faulty.units[3].resumed_from.startswith("checkpoint ep1-ba9")  # a mid-epoch checkpoint
    assert clean.samples_seen == faulty.samples_seen == 2 * N
    weights = [
        CheckpointStore(r.checkpoint.rsplit("/", 3)[0], r.run_name)
        .load_latest(["state.pt"])
        .objects["state.pt"]["state"]
        for r in (clean, faulty)
    ]
    for part in ("model", "optimizer", "scheduler"):
        assert torch.equal(
            torch.cat([t.flatten().float() for t in _tensors(weights[0][part])]),
            torch.cat([t.flatten().float() for t in _tensors(weights[1][part])]),
        ), part
    assert weights[0]["scheduler"] == weights[1]["scheduler"]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj.reshape(-1) if obj.dim() else obj.reshape(1)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield torch.tensor([float(obj)])
