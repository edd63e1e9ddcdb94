"""A new run from a full checkpoint (ours, or a peer's real file) carries the optimizer's state and the progress, trains
with its own hyper-parameters, and refuses at start-up what does not fit: named keys, never torch's message alone."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from checkpointing import CheckpointStore
from training.config import ConfigError
from training.recipe.loader import allow_recipe
from training.run import Run
from training.start.warm_start import check_load_path
from training.unit.loop import run_unit
from training.unit.session import restore

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
COMPOSER = str(PEERS / "composer" / "ep2.pt")


def train_to_end(config) -> None:
    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))


def source_run(make_config, **overrides):
    """Run 'a' of the synthetic recipe, 2 epochs with lr 0.1: the full checkpoint a new run starts from."""
    config = make_config(run_name="a", max_duration="2ep", recipe_args={"num_samples": 256, "lr": 0.1}, **overrides)
    train_to_end(config)
    return config


# -- hyper-parameters of a new run ----------------------------------------------------------------------
def test_a_new_run_from_our_checkpoint_keeps_its_own_learning_rate_and_carries_the_momentum(make_config, caplog):
    a = source_run(make_config)
    saved = CheckpointStore(a.save_folder, "a").load_latest(["state.pt"]).objects["state.pt"]["state"]
    b = make_config(run_name="b", max_duration="4ep", load_path=f"{a.save_folder}/a",
                    recipe_args={"num_samples": 256, "lr": 0.01})  # fmt: skip
    with caplog.at_level(logging.INFO):
        session, origin = restore(b, CheckpointStore(b.save_folder, "b"))
    assert origin.kind == "load_path" and session.progress.step == 16
    group = session.optimizer.param_groups[0]
    assert group["initial_lr"] == 0.01 and group["lr"] == pytest.approx(0.01 * min(1.0, 17 / 20))  # warm-up, step 16
    assert session.scheduler.base_lrs == [0.01] and session.scheduler.last_epoch == 16
    for i, param in enumerate(session.model.parameters()):  # the state (moments) is the checkpoint's
        assert torch.equal(
            session.optimizer.state[param]["momentum_buffer"], saved["optimizer"]["state"][i]["momentum_buffer"]
        )
    assert "this run's optimizer hyper-parameters apply, not the checkpoint's: lr 0.1 -> 0.01 (checkpoint's -> " \
           "this run's)" in caplog.text  # fmt: skip


def test_a_peers_learning_rate_gives_way_to_this_runs(make_config, caplog):
    config = make_config(
        run_name="b", max_duration="4ep", load_path=COMPOSER, recipe_args={"num_samples": 256, "lr": 0.2}
    )
    with caplog.at_level(logging.INFO):
        session, _ = restore(config, CheckpointStore(config.save_folder, "b"))
    assert session.optimizer.param_groups[0]["initial_lr"] == 0.2  # Composer's file says 0.05
    assert "lr 0.05 -> 0.2 (checkpoint's -> this run's)" in caplog.text


# -- what does not fit, refused before anything is written ----------------------------------------------
def test_our_folder_that_does_not_fit_the_model_is_refused_at_start_naming_the_keys(make_config):
    a = source_run(make_config)
    b = make_config(run_name="b", max_duration="4ep", load_path=f"{a.save_folder}/a",
                    recipe_args={"num_samples": 256, "hidden": 8})  # fmt: skip
    with pytest.raises(ConfigError) as info:
        Run.open(b)
    assert str(info.value) == (
        f"load_path={a.save_folder + '/a'!r} (ep2-ba16-sa512) does not fit the model this configuration builds: "
        f"3 of another shape ('0.bias' file [32] vs model [8], '0.weight' file [32, 16] vs model [8, 16], "
        f"'3.weight' file [4, 32] vs model [4, 8]); check recipe and recipe_args, or take the weights that fit: "
        f"load_weights_only=true load_strict=false"
    )
    assert not os.path.exists(os.path.join(b.save_folder, "b"))  # not even a writer claim


def test_a_resume_into_a_model_the_recipe_changed_names_the_keys(make_config, monkeypatch):
    a = source_run(make_config)
    from recipes.synthetic import SyntheticRecipe

    build = SyntheticRecipe.build_model
    monkeypatch.setattr(SyntheticRecipe, "build_model", lambda self: build(self).append(torch.nn.Linear(4, 2)))
    with pytest.raises(ConfigError) as info:
        restore(a, CheckpointStore(a.save_folder, "a"))
    message = str(info.value)
    assert message.startswith(f"checkpoint {a.save_folder}/a/checkpoints/ep2-ba16-sa512 does not fit the model ")
    assert "2 missing from the file ('4.bias', '4.weight'); the recipe builds another model" in message
    assert "load_path=" in message and "load_weights_only=true load_strict=false" in message


def test_a_peers_optimizer_of_another_kind_is_refused_at_start(make_config):
    allow_recipe("tests.recipes_for_tests:AdamRecipe")
    config = make_config(
        run_name="b", max_duration="4ep", load_path=COMPOSER, recipe="tests.recipes_for_tests:AdamRecipe"
    )
    with pytest.raises(ConfigError) as info:
        Run.open(config)
    assert str(info.value) == (
        f"load_path={COMPOSER!r}: its optimizer state is another optimizer's (its groups have ['dampening', "
        f"'momentum', 'nesterov'], the recipe's Adam has ['amsgrad', 'betas', 'eps']); set load_weights_only=true to "
        f"take the weights alone"
    )
    assert not os.path.exists(os.path.join(config.save_folder, "b"))
    check_load_path(config.model_copy(update={"load_weights_only": True}))  # the fix it names


def test_a_peers_progress_past_max_duration_is_refused_at_start(make_config):
    config = make_config(run_name="b", max_duration="2ep", load_path=COMPOSER)
    with pytest.raises(ConfigError) as info:
        Run.open(config)
    assert str(info.value) == (
        f"load_path={COMPOSER!r} stands at epoch 2, step 4 (128 samples), which load_weights_only=false carries "
        f"over and which already reaches max_duration='2ep': set max_duration past it (it counts the whole run, as "
        f"Composer's does), or load_weights_only=true to take the weights alone and count from zero"
    )
    assert not os.path.exists(os.path.join(config.save_folder, "b"))


def test_a_strict_check_counts_a_tied_head_as_given_by_its_embedding(make_config, tmp_path):
    allow_recipe("tests.recipes_for_tests:TiedHeadRecipe")
    config = make_config(
        run_name="b", recipe="tests.recipes_for_tests:TiedHeadRecipe", load_path=str(tmp_path / "w.safetensors")
    )
    from tests.recipes_for_tests import TiedHeadRecipe

    model = TiedHeadRecipe().build_model()
    safetensors.torch.save_file({"wte.weight": model.wte.weight.detach()}, config.load_path)  # one key of the pair
    check_load_path(config)  # strict: head.weight is filled through the tie, not missing


def test_partial_loads_take_weights_only_and_say_why(make_config, caplog):
    config = make_config(run_name="b", load_path=COMPOSER, load_ignore_keys=["3.*"],
                         recipe_args={"num_samples": 256, "num_classes": 5})  # fmt: skip
    with caplog.at_level(logging.INFO):
        session, origin = restore(config, CheckpointStore(config.save_folder, "b"))
    assert origin.text.startswith("weights of ") and session.progress.step == 0 and not session.optimizer.state
    assert "load_path: weights only (2 model keys keep their initialization (load_ignore_keys / load_strict=false)" \
           in caplog.text  # fmt: skip


def test_fsdp_takes_weights_only_from_our_folder_and_says_so_at_start(make_config):
    a = source_run(make_config)
    config = make_config(run_name="b", max_duration="4ep", load_path=f"{a.save_folder}/a", parallelism="fsdp")
    with pytest.raises(
        ConfigError, match=r"with parallelism='fsdp' a new run takes weights only; set load_weights_only"
    ):
        check_load_path(config)
    check_load_path(config.model_copy(update={"load_weights_only": True}))
