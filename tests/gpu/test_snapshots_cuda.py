"""Snapshots on CUDA: the state is copied on a side stream into pinned host buffers (the host-memory tier's slots,
page-locked with cudaHostRegister), the next optimizer step waits on the GPU for that copy, and what reaches the tier
is the state as the step left it, bit for bit. No Prefect: units are driven as the task would drive them."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.commit.committer import Committer
from checkpointing.host_tier.tier import HostTier
from training.exceptions import InjectedFault
from training.recipe.loader import ALLOWED_ENV
from training.run import Run, execute_unit
from training.start.store import open_store
from training.unit import session as sessions
from training.unit.checkpointer import Checkpointer
from training.unit.evaluation import to_device
from training.unit.warm import PROCESS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SYNTHETIC = "recipes.synthetic:SyntheticRecipe"


@pytest.fixture(autouse=True)
def _synthetic_allowed(monkeypatch):
    """The recipe allowed in the environment; the tier in a tmpfs folder (/dev/shm), where CUDA can page-lock it."""
    monkeypatch.setenv(ALLOWED_ENV, ",".join(filter(None, [os.environ.get(ALLOWED_ENV), SYNTHETIC])))
    shm = tempfile.mkdtemp(prefix="tier-", dir="/dev/shm")
    monkeypatch.setenv("TRAIN_HOST_TIER_DIR", shm)
    yield
    PROCESS.committer.drop_snapshots()
    PROCESS.forget()
    shutil.rmtree(shm, ignore_errors=True)


def config(tmp_path, name: str, **kw):
    from training.config import TrainConfig

    values = dict(
        run_name=name,
        save_folder=str(tmp_path / "runs"),
        recipe=SYNTHETIC,
        recipe_args={"num_samples": 512, "hidden": 1024, "num_layers": 3},
        max_duration="2ep",
        save_interval="1ep",
        snapshot_interval="1ba",
        global_batch_size=32,
        device="cuda",
        seed=3,
    )
    values.update(kw)
    return TrainConfig(**values)


def weights(cfg) -> dict:
    store = CheckpointStore(cfg.save_folder, cfg.run_name)
    return store.load(store.latest(), ["state.pt"]).objects["state.pt"]["state"]["model"]


FAULT_USAGE: list[tuple[bool, bool]] = []  # (pinned, shared) of the snapshot buffers when a unit failed


def run_all(cfg, forget_store_snapshots: bool = False) -> list:
    """Units until the run is complete; a unit that fails (an injected fault) is tried again, as Prefect would. With
    ``forget_store_snapshots``, the snapshots inside the unit that reached the store are deleted after the failure,
    as if the uploads had not landed: the retry can only find them in the host-memory tier."""
    results = []
    with Run.open(cfg) as run:
        attempt = 1
        while not run.complete:
            try:
                result = execute_unit(
                    cfg, unit=run.next_unit, start_checkpoint=run.head, attempt=attempt, generation=run.generation
                )
            except InjectedFault:
                attempt += 1
                # the buffers the retry resumes from (a completed run frees them: look now)
                pipeline = PROCESS.committer.snapshots
                if pipeline is not None:
                    FAULT_USAGE.append((pipeline.usage.pinned, pipeline.usage.shared))
                PROCESS.committer.drop_snapshots()  # its uploads land (or fail) now, not after what follows
                if forget_store_snapshots:
                    store = CheckpointStore(cfg.save_folder, cfg.run_name)
                    for info in store.list():
                        if info.manifest.metadata.get("within_unit"):
                            store.delete(info.name)
                continue
            run.record(result)
            results.append(result)
            attempt = 1
    return results


def test_cuda_snapshots_every_step_then_a_retry_from_pinned_host_memory_match_an_uninterrupted_run(tmp_path):
    clean = config(tmp_path, "clean", snapshot_interval=None)
    run_all(clean)
    PROCESS.forget()
    FAULT_USAGE.clear()
    faulty = config(tmp_path, "faulty", inject_fault_at_step=20)
    results = run_all(faulty, forget_store_snapshots=True)
    assert results[0].origin == "fresh"
    assert results[1].origin == "host" and results[1].steps == 12  # 16 steps an epoch: resumed at 20 from memory
    assert FAULT_USAGE[-1:] == [(True, True)]  # the state it resumed from was in pinned, shared host buffers
    a, b = weights(clean), weights(faulty)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_after_a_snapshot_waits_for_its_copy_so_the_tier_holds_the_state_as_the_step_left_it(tmp_path):
    cfg = config(tmp_path, "race", recipe_args={"num_samples": 512, "hidden": 4096, "num_layers": 4})
    store = open_store(cfg)
    s, _ = sessions.restore(cfg, store)
    checkpointer = Checkpointer(cfg, store, Committer())
    batch = to_device(next(iter(torch.utils.data.DataLoader(s.dataset, batch_size=32))), s.device)

    def step() -> None:
        s.optimizer.zero_grad()
        s.recipe.loss(s.model, batch).backward()
        s.optimizer.step()

    for _ in range(3):
        step()
        checkpointer.snapshot(s, {"train_loss": 0.0})
        expected = {k: v.detach().to("cpu", copy=True) for k, v in s.model.state_dict().items()}
        step()  # at once: its kernels must wait for the snapshot's copy, or the copy reads updated weights
        checkpointer.snapshots._wait_published()
        tier = HostTier(store.uri)
        index, record = max(tier.records(0), key=lambda r: r[1].seq)
        saved = tier.load(index, record, 0)["state.pt"]["state"]["model"]
        tier.close()
        assert all(torch.equal(saved[k], expected[k]) for k in expected)
    checkpointer.committer.drop_snapshots()
