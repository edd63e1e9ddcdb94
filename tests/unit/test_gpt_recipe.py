"""The GPT recipe (a port of nanoGPT's train.py) trained by the product: accumulation, clipping and bf16 together,
nanoGPT's two AdamW groups, a schedule built from ``ctx.total_steps``, and an exact cold resume. Units run in this
process (no Prefect), as a Prefect task would run them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from recipes.gpt import GPTRecipe
from training.recipe.loader import load_recipe, open_dataset
from training.unit.loop import run_unit
from training.unit.warm import PROCESS

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}


@pytest.fixture
def gpt_config(make_config):
    """The recipe as docs/porting-nanogpt.md runs it (registered name, accumulation, clipping, bf16), tiny."""

    def make(**overrides):
        values = dict(recipe="gpt", recipe_args=TINY, global_batch_size=16, grad_accumulation=2, grad_clip_norm=1.0,
                      precision="bf16", max_duration="30ba", save_interval="10ba")  # fmt: skip
        values.update(overrides)
        return make_config(**values)

    return make


def final_state(config) -> dict:
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest().name, files=[STATE_FILE]).objects[STATE_FILE]["state"]


@pytest.mark.slow  # trains the GPT recipe until its loss goes down
def test_it_trains_with_accumulation_clipping_and_bf16_and_the_loss_goes_down(gpt_config):
    config = gpt_config(eval_interval="10ba")
    units = []
    while not (units and units[-1].complete):
        units.append(run_unit(config))
    first, last = units[0].metrics, units[-1].metrics
    assert [u.steps for u in units] == [10, 10, 10]
    assert last["train_loss"] < first["train_loss"] - 0.25  # mean training loss of steps 21-30 vs steps 1-10
    assert last["eval_loss"] < first["eval_loss"]  # and on the held-out split
    assert last["eval_bits_per_char"] == pytest.approx(last["eval_loss"] / math.log(2))
    assert "grad_norm" in last  # clipping ran: the product reports the norm before clipping


def test_a_sample_is_the_block_at_its_id_times_the_stride():
    recipe = GPTRecipe(**TINY, stride=5)
    data = recipe.train_dataset()
    x, y = data[7]
    assert torch.equal(x, recipe._train[35:67]) and torch.equal(y, recipe._train[36:68])
    assert len(data) == (len(recipe._train) - 32 - 1) // 5 + 1  # the last block still has its shifted target
    text = recipe.decode(data[0][0])
    assert text == "First Citizen:\nBefore we proceed"  # the corpus ships inside the package


@pytest.mark.parametrize("bias", [False, True])
def test_weight_decay_applies_exactly_to_weights_of_two_or_more_dimensions(bias):
    recipe = GPTRecipe(**TINY, bias=bias, weight_decay=0.1)
    model = recipe.build_model()
    decay, no_decay = recipe.build_optimizer(model).param_groups
    params = list(model.parameters())  # the tied embedding/head weight appears once
    assert {id(p) for p in decay["params"]} == {id(p) for p in params if p.dim() >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in params if p.dim() < 2}
    assert len(decay["params"]) + len(no_decay["params"]) == len(params)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {n for n, p in model.named_parameters() if p.dim() < 2}
    assert all(".ln_" in n or n.startswith("ln_f") or n.endswith(".bias") for n in names)


def test_the_lr_schedule_warms_up_then_decays_to_min_lr_at_the_run_s_last_step(gpt_config):
    args = {**TINY, "stride": 64, "warmup_steps": 5, "lr": 1e-3, "min_lr": 1e-4}
    config = gpt_config(recipe_args=args, max_duration="2ep", grad_accumulation=1)
    recipe = load_recipe(config)
    dataset = open_dataset(recipe)
    total = recipe.ctx.total_steps
    assert total == 2 * math.ceil(len(dataset) / 16)  # from the dataset's size, not a number copied by hand
    optimizer = recipe.build_optimizer(recipe.build_model())
    scheduler = recipe.build_scheduler(optimizer)
    lrs = []
    for _ in range(total):  # the lr each optimizer step trains with, as the product steps the scheduler
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert all(a == b for a, b in lrs)  # both groups follow the same schedule
    lr = [a for a, _ in lrs]
    assert lr[:6] == pytest.approx([1e-3 * (i + 1) / 6 for i in range(5)] + [1e-3])  # nanoGPT's warm-up
    assert all(a > b for a, b in itertools.pairwise(lr[5:]))  # then strictly down ...
    assert lr[-1] == pytest.approx(1e-4) and lr[-2] > 1e-4  # ... reaching min_lr at the last step


@pytest.mark.slow  # trains the GPT recipe twice (about a minute of CPU)
def test_a_cold_resume_ends_bit_identical_to_an_uninterrupted_run(gpt_config):
    args = {**TINY, "dropout": 0.2}  # dropout draws from torch's RNG: the resume must restore it exactly
    whole = gpt_config(run_name="whole", recipe_args=args, save_interval="30ba", eval_interval="10ba")
    cold = whole.model_copy(update={"run_name": "cold", "save_interval": "10ba"})
    assert run_unit(whole).complete
    units = 0
    while not run_unit(cold).complete:
        units += 1
        PROCESS.forget()  # as if each unit ran in a new process: everything comes back from the store
    assert units == 2
    a, b = final_state(whole), final_state(cold)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 30
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True):
        assert torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])


def test_a_resume_on_another_corpus_is_refused_not_retrained(gpt_config, tmp_path, monkeypatch):
    import recipes.gpt
    from training.config import ConfigError

    config = gpt_config(max_duration="4ba", save_interval="2ba")
    run_unit(config)
    assert final_state(config)["recipe"]["corpus_sha256"] == GPTRecipe(**TINY).corpus_sha256
    other = tmp_path / "reversed.txt"  # the same characters, so the same vocabulary size: the weights would load
    other.write_text(recipes.gpt.CORPUS.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    monkeypatch.setattr(recipes.gpt, "CORPUS", other)
    PROCESS.forget()
    with pytest.raises(ConfigError, match="trained on a corpus with sha256"):
        run_unit(config)
