"""CUDA paths, run where a GPU is present (CI has none; see README for how they were checked).

No Prefect here: units are driven directly, as the task would, so this runs on a bare GPU image.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from checkpointing import CheckpointStore
from training.config import TrainConfig
from training.distributed.gang import close_gangs
from training.exceptions import InjectedFault
from training.recipe.loader import ALLOWED_ENV
from training.run import Run, execute_unit
from training.unit.warm import PROCESS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SYNTHETIC = "recipes.synthetic:SyntheticRecipe"


@pytest.fixture(autouse=True)
def _synthetic_allowed(monkeypatch):
    """The recipe is allowed as a worker allows one, in the environment: a GPU machine may run these tests from a
    checkout on PYTHONPATH, without the entry points that `pip install -e .` registers (scripts/gpu_check.sh)."""
    monkeypatch.setenv(ALLOWED_ENV, ",".join(filter(None, [os.environ.get(ALLOWED_ENV), SYNTHETIC])))


def config(tmp_path, name: str, **kw) -> TrainConfig:
    values = dict(
        run_name=name,
        save_folder=str(tmp_path / "runs"),
        recipe=SYNTHETIC,
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
    """What the train flow does, without Prefect: units until the run is complete, a failed unit tried again."""
    with Run.open(cfg) as run:
        attempt = 1
        while not run.complete:
            try:
                run.record(execute_unit(cfg, unit=run.next_unit, start_checkpoint=run.head, attempt=attempt,
                                        generation=run.generation))  # fmt: skip
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
    # one process with FSDP: the smallest configuration that runs on torchrun ranks, on a one-GPU machine
    cfg = config(tmp_path, "nccl", nproc_per_node=1, parallelism="fsdp", max_duration="2ep")
    with caplog.at_level(logging.INFO):
        try:
            with Run.open(cfg) as run:
                first = execute_unit(cfg, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation)
                run.record(first)
                second = execute_unit(cfg, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation)
        finally:
            close_gangs()
    assert "joined a nccl process group" in caplog.text
    assert second.resumed_from == f"checkpoint {first.checkpoint_name}" and second.complete
