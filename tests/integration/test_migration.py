"""Migration, one test per seed system: a checkpoint written by Composer, MindSpore or Ray Train itself (the committed
fixtures, tests/fixtures/peers) starts a new run here, which loads what can be carried over (weights, the optimizer's
moments, the progress) and goes on training through the Prefect-free lifecycle (training.run.Run + run_unit), as the
train flow drives it; Lightning's file, and Composer's from S3 through the flow itself, besides."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch

from checkpointing import CheckpointStore
from tests.interop_stores import put
from training.position.progress import Progress
from training.run import Run
from training.unit.loop import run_unit
from training.unit.session import restore

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
RAY = next((PEERS / "ray").iterdir())
MS_FULL = PEERS / "mindspore" / "checkpoint" / "rank_0"


def reference(name: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(PEERS / f"{name}.reference.safetensors")


def expected(name: str) -> dict:
    return json.loads((PEERS / f"{name}.expected.json").read_text())


def loaded(config):
    """What a unit of the new run starts from: the session ``restore`` builds (recipe objects, then load_path)."""
    session, origin = restore(config, CheckpointStore(config.save_folder, config.run_name))
    assert origin.kind == "load_path"
    return session


def assert_carried(session, weights: dict, moments: dict) -> None:
    for name, param in session.model.named_parameters():
        assert torch.equal(param.detach(), weights[name]), name
        assert torch.equal(session.optimizer.state[param]["momentum_buffer"], moments[name]), name


def continue_training(config) -> tuple[Run, dict[str, torch.Tensor]]:
    """Trains the new run to max_duration; returns it and the optimizer state of its first checkpoint."""
    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
    store = CheckpointStore(config.save_folder, config.run_name)
    first = store.load(store.list()[0], ["state.pt"]).objects["state.pt"]["state"]
    return run, first


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(not torch.equal(before[k], after[k]) for k in before)


# -- Composer (seeds 000-002) -------------------------------------------------------------------------------------
def test_composer_checkpoint_carries_weights_moments_and_progress_then_trains_on(make_config, caplog):
    ref, facts = reference("composer"), expected("composer")
    names = [n for n, _ in _tiny().named_parameters()]
    weights, moments = {n: ref[n] for n in names}, {n: ref[f"momentum.{i}"] for i, n in enumerate(names)}
    config = make_config(run_name="from-composer", load_path=str(PEERS / "composer" / "ep2.pt"), max_duration="4ep")
    with caplog.at_level(logging.INFO):
        session = loaded(config)
    assert_carried(session, weights, moments)
    # Composer trained 2 epochs, 8 batches of 16: 128 samples. At this run's 32 a batch that is step 4.
    assert facts["progress"]["step"] == 8 and facts["progress"]["samples_seen"] == 128
    assert session.progress == Progress(epoch=2, step=4, samples_seen=128, sample_in_epoch=0, global_batch_size=32)
    assert session.scheduler.last_epoch == 4  # the recipe's schedule, at the carried step
    assert "from a Composer checkpoint (composer 0.32.1) took weights" in caplog.text
    assert "Left: rng (Composer's per-rank Python/NumPy/torch RNG states" in caplog.text

    run, first = continue_training(config)
    assert [u.checkpoint_name for u in run.units] == ["ep3-ba12-sa384", "ep4-ba20-sa640"]  # on from epoch 2, step 4
    assert run.units[0].origin == "load_path" and run.progress.samples_seen == 640
    assert moved(weights, {n: first["model"][n] for n in names})
    assert moved(moments, {n: first["optimizer"]["state"][i]["momentum_buffer"] for i, n in enumerate(names)})


# -- MindSpore Transformers (seed 003) ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_mindspore_checkpoint_carries_weights_momentum_and_progress_then_trains_on(fmt, make_config):
    ref = reference("mindspore")
    names = [n for n, _ in _tiny().named_parameters()]
    weights = {n: ref[f"{fmt}/{n}"] for n in names}
    moments = {n: ref[f"{fmt}/moments.{n}"] for n in names}  # nn.Momentum's accumulators, SGD's momentum buffers
    config = make_config(run_name="from-mindspore", load_path=str(MS_FULL / f"tiny_rank_0-2_4.{fmt}"),
                         max_duration="3ep")  # fmt: skip
    session = loaded(config)
    assert_carried(session, weights, moments)
    # epoch_num 2, global_step 8; MindSpore records no sample count: 2 epochs of this run's 256 samples, which its 4
    # steps an epoch took in batches of 64; at this run's 32 a batch that is step 16, where a native run stands
    assert session.progress == Progress(epoch=2, step=16, samples_seen=512, sample_in_epoch=0, global_batch_size=32)

    run, first = continue_training(config)
    assert [u.checkpoint_name for u in run.units] == ["ep3-ba24-sa768"]
    assert moved(moments, {n: first["optimizer"]["state"][i]["momentum_buffer"] for i, n in enumerate(names)})


# -- Ray Train (seed 004) -------------------------------------------------------------------------------------------
def test_ray_checkpoint_carries_weights_and_optimizer_and_leaves_its_counters(make_config, caplog):
    ref = reference("ray")
    names = [n for n, _ in _tiny().named_parameters()]
    weights, moments = {n: ref[n] for n in names}, {n: ref[f"momentum.{i}"] for i, n in enumerate(names)}
    config = make_config(run_name="from-ray", load_path=str(RAY), max_duration="1ep")
    with caplog.at_level(logging.INFO):
        session = loaded(config)
    assert_carried(session, weights, moments)
    assert session.progress == Progress(global_batch_size=32)  # the user's own counters: their meaning is theirs
    assert "Left: progress {'epoch': 1, 'step': 8} (the user's own keys" in caplog.text

    run, first = continue_training(config)
    assert [u.checkpoint_name for u in run.units] == ["ep1-ba8-sa256"]
    assert moved(moments, {n: first["optimizer"]["state"][i]["momentum_buffer"] for i, n in enumerate(names)})


# -- Lightning (not a seed; the file users bring most) ---------------------------------------------------------------
def test_lightning_checkpoint_carries_weights_moments_and_progress_then_trains_on(make_config):
    ref = reference("lightning")
    names = [n for n, _ in _tiny().named_parameters()]
    weights, moments = {n: ref[f"model.{n}"] for n in names}, {n: ref[f"momentum.{i}"] for i, n in enumerate(names)}
    config = make_config(
        run_name="from-lightning", load_path=str(PEERS / "lightning" / "last.ckpt"), max_duration="3ep"
    )
    session = loaded(config)
    assert_carried(session, weights, moments)
    # global_step 8 in 2 epochs: batches of 64 of this run's 256 samples; at this run's 32 a batch, step 16
    assert session.progress == Progress(epoch=2, step=16, samples_seen=512, sample_in_epoch=0, global_batch_size=32)
    run, _ = continue_training(config)
    assert [u.checkpoint_name for u in run.units] == ["ep3-ba24-sa768"]


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
# -- through the flow: Composer's upload layout on S3 -----------------------------------------------------------------
@pytest.mark.usefixtures("prefect_harness")
def test_the_train_flow_continues_composers_latest_symlink_on_s3(make_config, s3):
    from flows.train import train

    folder, options = s3
    bucket = folder.split("://", 1)[1].split("/", 1)[0]
    put(f"s3://{bucket}/composer/checkpoints/ep2.pt", (PEERS / "composer" / "ep2.pt").read_bytes(), options)
    put(f"s3://{bucket}/composer/checkpoints/latest-rank0.pt.symlink", b"composer/checkpoints/ep2.pt", options)
    config = make_config(run_name="from-composer", save_folder=folder, storage_options=options, max_duration="3ep",
                         load_path=f"s3://{bucket}/composer/checkpoints/latest-rank0.pt.symlink",
                         recipe_args={"num_samples": 256, "lr": 0.01})  # fmt: skip
    result = train(config)
    assert (result.epoch, result.step, result.samples_seen) == (3, 12, 384)  # one epoch on from Composer's epoch 2
    assert result.units[0].resumed_from.startswith("state of s3://") and len(result.units) == 1


def _tiny() -> torch.nn.Module:
    from recipes.synthetic import SyntheticRecipe

    return SyntheticRecipe().build_model()
