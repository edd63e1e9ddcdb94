"""CUDA paths, run where a GPU is present (CI has none; see README for how they were checked).

No Prefect here: units are driven directly, as the task would, so this runs on a bare GPU image.
"""

from __future__ import annotations

import logging

import pytest
import torch

from checkpointing import CheckpointStore
from training.config import TrainConfig
from training.distributed import launch_unit
from training.loop import InjectedFault, run_unit
from training.warm import PROCESS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def config(tmp_path, name: str, **kw) -> TrainConfig:
    values = dict(
        run_name=name,
        save_folder=str(tmp_path / "runs"),
        recipe="recipes.synthetic:SyntheticRecipe",
        recipe_args={"num_samples": 512, "hidden": 256},
        max_duration="4ep",
        save_interval="1ep",
        global_batch_size=32,
        device="cuda",
        seed=3,
    )
    values.update(kw)
    return TrainConfig(**values)


def run_all(cfg: TrainConfig, fail_once: bool = False) -> None:
    attempt, done = 1, False
    while not done:
        try:
            done = run_unit(cfg, attempt=attempt).complete
            attempt = 1
        except InjectedFault:
            assert fail_once
            attempt += 1


def weights(cfg: TrainConfig) -> dict:
    store = CheckpointStore(cfg.save_folder, cfg.run_name)
    return store.load(store.latest(), ["state.pt"]).objects["state.pt"]["state"]["model"]


def test_cuda_run_with_a_retried_fault_matches_an_uninterrupted_one(tmp_path):
    clean, faulty = config(tmp_path, "clean"), config(tmp_path, "faulty", inject_fault_at_step=40)
    run_all(clean)
    PROCESS.forget()
    run_all(faulty, fail_once=True)
    a, b = weights(clean), weights(faulty)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.device.type == "cpu" for t in a.values())  # checkpoints load onto the CPU first


def test_cuda_rng_state_is_saved_and_restored(tmp_path):
    cfg = config(tmp_path, "rng", max_duration="1ep")
    run_all(cfg)
    store = CheckpointStore(cfg.save_folder, cfg.run_name)
    saved = store.load(store.latest(), ["rng-rank0.pt"]).objects["rng-rank0.pt"]
    assert len(saved["cuda"]) == torch.cuda.device_count()
    assert torch.equal(saved["cuda"][0], torch.cuda.get_rng_state(0))


def test_torchrun_unit_uses_nccl_on_cuda(tmp_path, caplog):
    cfg = config(tmp_path, "nccl", nproc_per_node=1, max_duration="2ep")
    log = logging.getLogger("nccl-test")
    with caplog.at_level(logging.INFO, logger="nccl-test"):
        first = launch_unit(cfg, start_checkpoint=None, attempt=1, generation=1, log=log)
        second = launch_unit(cfg, start_checkpoint=None, attempt=1, generation=1, log=log)
    assert "joined a nccl process group" in caplog.text
    assert second.resumed_from == f"checkpoint {first.checkpoint_name}" and second.complete


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_mixed_precision_with_accumulation_and_clipping_resumes_bit_identically(tmp_path, precision):
    """fp16 on CUDA runs the GradScaler for real (unscale before clip, skipped steps on inf); its state is
    checkpointed, so a cold resume in a new process state ends with the same weights."""
    options = dict(precision=precision, grad_accumulation=2, grad_clip_norm=1.0, max_duration="2ep")
    warm, cold = config(tmp_path, "warm", **options), config(tmp_path, "cold", **options)
    run_all(warm)
    PROCESS.forget()
    while not run_unit(cold).complete:
        PROCESS.forget()
    a, b = weights(warm), weights(cold)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if precision == "fp16":
        store = CheckpointStore(cold.save_folder, cold.run_name)
        scaler = store.load(store.latest(), ["state.pt"]).objects["state.pt"]["state"]["scaler"]
        assert scaler["scale"] > 0
