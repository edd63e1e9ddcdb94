"""The training step real scripts need: accumulation, clipping, mixed precision, a custom step, the run
context and evaluation inside the run. Units run in this process (no Prefect), as a Prefect task would run them."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from recipes.synthetic import SyntheticRecipe
from training.config import ConfigError
from training.start.preflight import preflight
from training.unit import rng
from training.unit.loop import run_unit
from training.unit.warm import PROCESS

NO_DROPOUT = {"num_samples": 256, "dropout": 0.0}


def final_state(config) -> dict:
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest().name, files=[STATE_FILE]).objects[STATE_FILE]["state"]


def train_all(config, cold: bool = False) -> None:
    """Every unit of the run; ``cold``: forget the in-memory state between units (a new process each time)."""
    while not run_unit(config).complete:
        if cold:
            PROCESS.forget()


def assert_same_tensors(a: dict, b: dict, exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


# -- gradient accumulation ------------------------------------------------------------------------
@pytest.mark.parametrize("global_batch_size", [32, 30])  # 30: micro-batches of 7, 7, 8, 8
def test_accumulation_makes_the_same_update_as_the_whole_batch(make_config, tmp_path, global_batch_size):
    whole = make_config(run_name="whole", max_duration="1ep", recipe_args=NO_DROPOUT,
                        global_batch_size=global_batch_size)  # fmt: skip
    micro = whole.model_copy(update={"run_name": "micro", "grad_accumulation": 4})
    train_all(whole)
    train_all(micro)
    a, b = final_state(whole)["model"], final_state(micro)["model"]
    assert_same_tensors(a, b, exact=False)  # the same sums, added in another order: float rounding only
    assert any(not torch.equal(a[k], b[k]) for k in a) or global_batch_size == 32  # really a different path


def test_micro_batches_are_loaded_one_at_a_time_and_freed(make_config, tmp_path):
    record = tmp_path / "rec"
    config = make_config(max_duration="3ba", save_interval="3ba", grad_accumulation=4,
                         recipe="tests.recipes_for_tests:MicroBatchRecipe",
                         recipe_args={**NO_DROPOUT, "record_dir": str(record)})  # fmt: skip
    run_unit(config)
    calls = [json.loads(line) for line in (record / "micro.jsonl").read_text().splitlines()]
    assert [c["size"] for c in calls] == [8] * 12  # 3 steps x 4 micro-batches of 32 / 4
    assert all(c["previous_freed"] for c in calls)  # a micro-batch's activations are gone before the next


# -- clipping --------------------------------------------------------------------------------------
def test_clipping_is_torchs_global_norm_clip_between_backward_and_step(make_config):
    config = make_config(max_duration="1ba", save_interval="1ba", shuffle=False, grad_clip_norm=0.05,
                         recipe_args=NO_DROPOUT)  # fmt: skip
    result = run_unit(config)

    recipe = SyntheticRecipe(**NO_DROPOUT)  # the same step by hand, as a plain PyTorch script writes it
    data = recipe.train_dataset()
    rng.seed_all(config.seed)
    model = recipe.build_model()
    optimizer = recipe.build_optimizer(model)
    recipe.build_scheduler(optimizer)
    batch = {"x": data.x[:32], "y": data.y[:32]}
    F.cross_entropy(model(batch["x"]), batch["y"]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()

    assert float(norm) > 0.05  # the clip did something
    assert result.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-6)  # the norm before clipping
    assert_same_tensors(final_state(config)["model"], model.state_dict())


# -- mixed precision ---------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resumes_bit_identically(make_config, precision):
    warm = make_config(run_name="warm", precision=precision, save_interval="3ba", max_duration="9ba")
    cold = warm.model_copy(update={"run_name": "cold"})
    train_all(warm)
    train_all(cold, cold=True)
    assert_same_tensors(final_state(warm)["model"], final_state(cold)["model"])
    fp32 = warm.model_copy(update={"run_name": "fp32", "precision": "fp32"})
    train_all(fp32)
    a, b = final_state(warm)["model"], final_state(fp32)["model"]
    assert any(not torch.equal(a[k], b[k]) for k in a)  # autocast really ran in the low precision


def test_fp16_checkpoints_its_grad_scaler(make_config):
    config = make_config(precision="fp16", save_interval="3ba", max_duration="6ba")
    run_unit(config)
    saved = final_state(config)["scaler"]
    assert saved is not None and saved["scale"] > 0 and saved["_growth_tracker"] == 3  # 3 good steps counted
    PROCESS.forget()
    run_unit(config)  # a cold resume continues the scaler's count instead of starting over
    assert final_state(config)["scaler"]["_growth_tracker"] == 6


# -- a custom step ---------------------------------------------------------------------------------
def test_a_custom_train_step_with_two_optimizers_resumes_exactly(make_config):
    recipe = "tests.recipes_for_tests:TwoOptimizerRecipe"
    warm = make_config(run_name="warm", recipe=recipe, save_interval="3ba", max_duration="9ba", grad_clip_norm=1.0)
    cold = warm.model_copy(update={"run_name": "cold"})
    train_all(warm)
    train_all(cold, cold=True)
    state = final_state(cold)
    assert state["recipe"]["head_optimizer"]["state"]  # the second optimizer's state is in the checkpoint
    assert_same_tensors(final_state(warm)["model"], state["model"])


def test_a_custom_train_step_refuses_grad_accumulation_it_would_ignore(make_config):
    config = make_config(recipe="tests.recipes_for_tests:TwoOptimizerRecipe", grad_accumulation=2)
    with pytest.raises(ConfigError, match="grad_accumulation=2: TwoOptimizerRecipe has its own train_step"):
        preflight(config)


# -- run context -----------------------------------------------------------------------------------
def test_the_recipe_sees_the_run_context_before_it_builds_its_schedule(make_config, tmp_path):
    record = tmp_path / "rec"
    config = make_config(recipe="tests.recipes_for_tests:ContextRecipe", max_duration="3ep", global_batch_size=48,
                         grad_accumulation=2, recipe_args={"num_samples": 256, "record_dir": str(record)})  # fmt: skip
    run_unit(config)
    seen = json.loads((record / "ctx-rank0.json").read_text())
    steps_per_epoch = math.ceil(256 / 48)
    assert seen == {"total_steps": 3 * steps_per_epoch, "total_samples": 768, "micro_batch_size": 24,
                    "world_size": 1, "rank": 0, "global_batch_size": 48, "precision": "fp32", "seed": 7}  # fmt: skip


# -- evaluation inside the run -----------------------------------------------------------------------
def test_eval_interval_puts_eval_metrics_in_the_manifest_and_they_drive_retention(make_config):
    config = make_config(eval_interval="4ba", max_duration="3ep", num_checkpoints_to_keep=1,
                         checkpoint_score_attribute="eval_loss", checkpoint_score_order="min")  # fmt: skip
    train_all(config)
    store = CheckpointStore(config.save_folder, config.run_name)
    infos = store.list()
    assert all({"eval_loss", "eval_accuracy", "eval_step"} <= set(i.metrics) for i in infos)
    assert all(i.metrics["eval_step"] == i.progress["step"] for i in infos)  # 4ba divides the 8-step epochs
    best = store.best("eval_loss", "min")
    assert best[0].metrics["eval_loss"] == min(i.metrics["eval_loss"] for i in best)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"checkpoint_score_attribute": "val_loss"}, "checkpoint_score_attribute='val_loss': no unit reports it"),
        ({"checkpoint_score_attribute": "eval_loss"}, "evaluation runs only at the end"),
        ({"checkpoint_score_attribute": "grad_norm"}, "no unit reports it"),  # only with grad_clip_norm
    ],
)
def test_a_score_attribute_no_unit_reports_is_refused_at_start_up(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight(make_config(num_checkpoints_to_keep=1, **overrides))


def test_an_eval_metric_the_recipe_does_not_report_fails_at_the_first_evaluation(make_config):
    config = make_config(eval_interval="2ba", checkpoint_score_attribute="eval_f1", num_checkpoints_to_keep=1)
    preflight(config)  # the recipe evaluates: the name can only be checked against what it reports
    with pytest.raises(ConfigError, match=r"'eval_f1': the recipe's evaluate reports \['eval_accuracy', 'eval_loss'\]"):
        run_unit(config)
    assert CheckpointStore(config.save_folder, config.run_name).list() == []  # nothing committed


def test_evaluating_inside_the_run_does_not_change_what_is_trained(make_config):
    plain = make_config(run_name="plain", max_duration="2ep")  # dropout on: any RNG draw would show
    evaluated = plain.model_copy(update={"run_name": "evaluated", "eval_interval": "3ba"})
    train_all(plain)
    train_all(evaluated)
    assert_same_tensors(final_state(plain)["model"], final_state(evaluated)["model"])
