"""A loop of the user's own: ctx.report commits checkpoints the units' way, ctx.get_checkpoint reads them back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.commit.committer import Committer
from training import LoopContext, ResumableBatchSampler
from training.config import ConfigError
from training.start.identity import check_same_run
from training.start.preflight import preflight
from training.unit.own_loop import LoopEndedEarlyError, ReportError, run_own_loop
from training.unit.warm import SessionCache

OWN_LOOP = "recipes.custom_loop:CustomLoopRecipe"


@pytest.fixture
def loop_config(make_config):
    def make(**overrides):
        values = dict(recipe=OWN_LOOP, recipe_args={"num_samples": 64}, max_duration="4ba")
        return make_config(**{**values, **overrides})

    return make


def open_context(config, attempt: int = 1, committer: Committer | None = None) -> LoopContext:
    store = CheckpointStore(config.save_folder, config.run_name)
    return LoopContext(config, store, committer=committer or Committer(), attempt=attempt)


class Opaque:
    """A class of the user's: unpickling it would mean importing and running their code."""


def state_at(i: int) -> dict:
    return {
        "model": {"w": torch.full((3, 2), float(i)), "b": torch.arange(2)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(i))}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
        },
        "epoch": 0,
        "sample_in_epoch": 32 * i,
        "dtype": torch.float32,  # not a plain type, but one weights_only loads: checked by a round trip, accepted
        "names": ["a", None, 1.5],
    }


@pytest.mark.parametrize("async_upload", [False, True])
def test_a_report_is_a_committed_checkpoint_that_the_next_attempt_gets_back(loop_config, async_upload):
    config, committer = loop_config(async_upload=async_upload), Committer()
    ctx = open_context(config, committer=committer)
    assert ctx.get_checkpoint() is None
    assert (ctx.global_batch_size, ctx.seed, ctx.rank, ctx.world_size, ctx.num_train_samples) == (32, 7, 0, 1, None)

    ctx.report({"loss": 0.5}, state=state_at(1))
    ctx.report({"loss": torch.tensor(0.25)}, state=state_at(2), samples_seen=64)
    committer.wait()  # the background upload, if any, lands

    store = CheckpointStore(config.save_folder, config.run_name)
    latest = store.latest(deep=True)
    assert latest.name == "ep0-ba2-sa64"  # step counts reports; samples_seen as given
    assert json.loads((Path(config.save_folder) / "r" / "latest").read_text())["name"] == latest.name
    assert (Path(latest.uri) / "manifest.json").exists()
    assert latest.metrics == {"loss": 0.25}
    assert latest.manifest.metadata["report"] == 1 and latest.manifest.metadata["train_loop"] is True
    assert latest.manifest.writer.generation == 0
    check_same_run(config, latest)  # the run identity is recorded as a unit's is
    weights = torch.load(Path(latest.uri) / "state.pt", weights_only=True)["state"]["model"]
    assert torch.equal(weights["w"], torch.full((3, 2), 2.0))  # the Composer path to the weights

    again = open_context(config, attempt=2)
    got = again.get_checkpoint()
    expected = state_at(2)
    assert torch.equal(got["model"]["w"], expected["model"]["w"]) and torch.equal(
        got["model"]["b"], expected["model"]["b"]
    )
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert (got["sample_in_epoch"], got["dtype"], got["names"]) == (64, torch.float32, ["a", None, 1.5])
    assert not again.should_stop
    again.report({"loss": 0.1}, state=state_at(3))
    again.report({"loss": 0.1}, state=state_at(4))  # step 4 reaches max_duration='4ba'
    assert again.should_stop
    assert again.finish().progress == {"epoch": 0, "step": 4, "samples_seen": 64}


def test_retention_keeps_the_n_best_reports_by_a_reported_metric_and_the_newest(loop_config):
    config = loop_config(num_checkpoints_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min",
                         max_duration="5ba")  # fmt: skip
    ctx = open_context(config)
    for i, loss in enumerate([0.5, 0.1, 0.9, 0.3, 0.7], start=1):
        ctx.report({"loss": loss}, state=state_at(i))

    names = [i.name for i in CheckpointStore(config.save_folder, config.run_name).list()]
    assert names == ["ep0-ba2-sa0", "ep0-ba4-sa0", "ep0-ba5-sa0"]  # the 2 best (loss 0.1, 0.3) and the newest


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"model": {"w": torch.ones(2)}, "fn": lambda x: x}, "state['fn'] is a lambda"),
        ({"model": {"w": torch.ones(2)}, "extra": [1, {"obj": Opaque()}]}, "state['extra'][1]['obj'] is a tests.unit"),
    ],
)
def test_a_state_that_would_need_code_to_load_is_refused_at_report_time(loop_config, bad, named):
    config = loop_config()
    ctx = open_context(config)
    ctx.report({"loss": 1.0}, state=state_at(1))

    with pytest.raises(ReportError, match="weights_only") as refused:
        ctx.report({"loss": 0.5}, state=bad)

    assert named in str(refused.value)
    assert [i.name for i in CheckpointStore(config.save_folder, config.run_name).list()] == ["ep0-ba1-sa0"]


def test_counters_never_go_back_and_metrics_must_be_numbers(loop_config):
    ctx = open_context(loop_config())
    ctx.report({"loss": 1.0}, state=state_at(1), step=3, epoch=1)
    with pytest.raises(ReportError, match=r"report\(step=2\): the run.s newest report is at step=3"):
        ctx.report({"loss": 1.0}, state=state_at(2), step=2)
    with pytest.raises(ReportError, match="'loss': 'low': use str names and numbers"):
        ctx.report({"loss": "low"}, state=state_at(2))
    ctx.report({"loss": 1.0}, state=state_at(2))
    assert ctx.result(steps=0).progress == {"epoch": 1, "step": 4, "samples_seen": 0}  # epoch kept, step counted on


def test_a_loop_that_returns_before_max_duration_fails_naming_it(make_config):
    config = make_config(recipe="tests.own_loop_recipes:ShortLoopRecipe", recipe_args={}, max_duration="3ba")
    with pytest.raises(LoopEndedEarlyError, match=r"before max_duration=3ba"):
        run_own_loop(config, cache=SessionCache())
    done = run_own_loop(make_config(recipe=config.recipe, recipe_args={}, max_duration="2ba"), cache=SessionCache())
    assert (done.complete, done.checkpoint_name, done.metrics["loss"]) == (True, "ep0-ba2-sa0", 0.5)


def test_fsdp_is_refused_for_a_loop_the_product_does_not_shard(loop_config):
    with pytest.raises(ConfigError, match="parallelism='fsdp': a recipe with train_loop shards nothing itself"):
        preflight(loop_config(parallelism="fsdp"))


def test_a_metrics_only_report_commits_nothing_and_the_loop_must_end_on_a_state(loop_config):
    config = loop_config(max_duration="2ba")
    ctx = open_context(config)
    ctx.report({"loss": 0.5}, state=state_at(1))
    ctx.report({"loss": 0.4}, step=2)  # step 2 reaches max_duration, but without a state
    assert ctx.should_stop
    assert [i.name for i in CheckpointStore(config.save_folder, config.run_name).list()] == ["ep0-ba1-sa0"]
    with pytest.raises(LoopEndedEarlyError, match="its newest report with a state"):
        ctx.finish()


def test_metrics_only_reports_leave_the_step_where_it_is(loop_config):
    config = loop_config(max_duration="2ba")
    ctx = open_context(config)
    ctx.report({"loss": 0.5}, state=state_at(1))
    for _ in range(3):
        ctx.report({"val_loss": 0.7})  # per-epoch metrics: no training the step counter could tell
    assert ctx.result(steps=0).progress["step"] == 1 and not ctx.should_stop
    ctx.report({"loss": 0.3}, state=state_at(2))
    assert ctx.should_stop
    names = [i.name for i in CheckpointStore(config.save_folder, config.run_name).list()]
    assert names == ["ep0-ba1-sa0", "ep0-ba2-sa0"]
    assert ctx.finish().progress["step"] == 2


def test_each_report_keeps_the_rank_s_rng_and_rank_state_and_get_checkpoint_gives_them_back(loop_config):
    import numpy as np

    config = loop_config(max_duration="1ba")
    ctx = open_context(config)
    torch.manual_seed(11)
    np.random.seed(12)
    ctx.report({"loss": 0.5}, state={"w": torch.ones(2)}, rank_state={"mine": torch.arange(3), "w": torch.zeros(2)})
    expected = (torch.rand(4), np.random.rand(4))
    torch.manual_seed(99)
    np.random.seed(99)

    got = open_context(config, attempt=2).get_checkpoint()
    assert got is not None and torch.equal(got["mine"], torch.arange(3))
    assert torch.equal(got["w"], torch.zeros(2))  # a rank's own keys are merged over the shared state's
    assert torch.equal(torch.rand(4), expected[0]) and np.array_equal(np.random.rand(4), expected[1])

    torch.manual_seed(99)
    open_context(config, attempt=3).get_checkpoint(restore_rng=False)
    assert not torch.equal(torch.rand(4), expected[0])


def test_rank_state_without_a_state_is_refused_and_must_load_without_code(loop_config):
    ctx = open_context(loop_config())
    with pytest.raises(ReportError, match=r"rank_state=\.\.\.\) on a metrics-only report"):
        ctx.report({"loss": 0.5}, rank_state={"x": 1})
    with pytest.raises(ReportError, match=r"rank_state\['fn'\] is a lambda"):
        ctx.report({"loss": 0.5}, state={"x": 1}, rank_state={"fn": lambda: 0})


def test_a_report_past_max_duration_is_committed_and_warned_about(loop_config, caplog):
    config = loop_config(max_duration="1ba")
    ctx = open_context(config)
    ctx.report({"loss": 0.5}, state=state_at(1))
    assert ctx.should_stop
    with caplog.at_level("WARNING"):
        ctx.report({"loss": 0.4}, state=state_at(2))
    assert "after max_duration=1ba was reached" in caplog.text
    assert CheckpointStore(config.save_folder, config.run_name).latest().name == "ep0-ba2-sa0"


def test_resumable_batch_sampler_is_public_and_resumes_at_the_saved_sample():
    whole = [i for ids in ResumableBatchSampler(10, 4, seed=1, epoch=3) for i in ids]
    resumed = [i for ids in ResumableBatchSampler(10, 4, seed=1, epoch=3, start=4) for i in ids]
    assert resumed == whole[4:]
