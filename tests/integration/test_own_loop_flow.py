"""A loop of the user's own through the real flow: a failure inside it is retried by Prefect and resumes from the
last report, ending with the weights of an uninterrupted run; and through the run's lifecycle (``train_run``): a
complete run relaunched returns at once."""

from __future__ import annotations

import json

import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort

from checkpointing import CheckpointStore
from flows.train import train

FLAKY = "tests.own_loop_recipes:FlakyOwnLoopRecipe"
NAMES = ["ep0-ba4-sa128", "ep1-ba8-sa256", "ep1-ba12-sa384", "ep2-ba16-sa512", "ep2-ba20-sa640", "ep3-ba24-sa768"]


def final_state(config) -> dict:
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest(), files=["state.pt"]).objects["state.pt"]["state"]


def metrics_table(run_name: str) -> list[dict]:
    """The rows of the run's metrics card in the Prefect UI (one per report)."""
    with get_client(sync_client=True) as client:
        [card] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"train-{run_name}-metrics"])),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    return json.loads(card.data)


def assert_same_state(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, s in a["optimizer"]["state"].items():
        assert torch.equal(s["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"]), i
    assert a["scheduler"] == b["scheduler"]
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")
def test_a_failure_inside_train_loop_is_retried_from_the_last_report_and_matches_an_uninterrupted_run(make_config):
    # 256 samples, batches of 32: 8 steps an epoch; reports at steps 4, 8 (epoch end), 12, ... 24 (3ep).
    args = {"num_samples": 256, "report_every": 4}
    clean = make_config(run_name="clean", recipe=FLAKY, recipe_args=args)
    flaky = make_config(run_name="flaky", recipe=FLAKY, recipe_args={**args, "fail_at_update": 10})

    a, b = train(clean), train(flaky)

    [loop] = b.units
    assert loop.attempt == 2  # Prefect's retry of the loop task
    assert loop.resumed_from == "checkpoint ep1-ba8-sa256"  # the 2nd report; steps 9-10 are trained again
    assert (a.epoch, a.step, a.samples_seen) == (b.epoch, b.step, b.samples_seen) == (3, 24, 768)
    assert [i.name for i in CheckpointStore(flaky.save_folder, "flaky").list()][-1] == "ep3-ba24-sa768"
    assert_same_state(final_state(clean), final_state(flaky))
    assert a.metrics == b.metrics and "train_loss" in a.metrics
    rows = metrics_table("flaky")  # each report moved the UI's cards, those of the failed attempt included
    assert [(r["step"], r["checkpoint"]) for r in rows] == [(s, n) for s, n in zip(range(4, 25, 4), NAMES, strict=True)]


def test_relaunching_a_complete_own_loop_run_trains_nothing_and_returns_the_same_result(make_config, train_run):
    config = make_config(recipe="own_loop", recipe_args={"num_samples": 64}, max_duration="2ep")
    first = train_run(config)
    again = train_run(config)

    assert first.units[0].complete and again.units == []
    assert again.started_from == f"checkpoint {first.checkpoint_name}"
    assert (again.checkpoint, again.step, again.metrics) == (first.checkpoint, first.step, first.metrics)
