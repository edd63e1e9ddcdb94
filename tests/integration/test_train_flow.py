"""The spine, end to end: units, reruns, warm starts and retention through the run's lifecycle (``train_run``:
training.run.Run, as the flow drives it), and what Prefect adds through the train flow itself: retries that resume,
and the command line's one-line errors."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from checkpointing import CheckpointStore
from flows.train import done_line, train
from tests import recipes_for_tests
from tests.conftest import ROOT


def final_weights(config) -> dict[str, torch.Tensor]:
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest(), files=["state.pt"]).objects["state.pt"]["state"]["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")
def test_retried_unit_resumes_from_previous_checkpoint_and_matches_uninterrupted_run(make_config, tmp_path):
    clean = make_config(run_name="clean")
    faulty = make_config(run_name="faulty", inject_fault_at_step=12)  # inside unit 1 (8 steps per epoch)

    a, b = train(clean), train(faulty)

    assert (a.epoch, a.step, a.samples_seen) == (b.epoch, b.step, b.samples_seen) == (3, 24, 768)
    assert [u.unit for u in b.units] == [0, 1, 2]
    assert b.units[1].resumed_from == f"checkpoint {b.units[0].checkpoint_name}"  # downloaded, not in memory
    assert b.units[1].attempt == 2 and b.units[1].previous_failure == (
        "InjectedFault: injected fault after step 12 (inject_fault_at_step=12, attempt 1)"
    )  # the run's last line says what failed, not only that something did
    assert "Unit 1 failed once (InjectedFault: injected fault after step 12" in done_line(b)
    assert len(CheckpointStore(faulty.save_folder, "faulty").list()) == 3
    assert_same_weights(final_weights(clean), final_weights(faulty))
    assert a.metrics == b.metrics


def test_rerun_after_completion_trains_nothing_and_returns_same_result(make_config, train_run):
    config = make_config()
    first = train_run(config)
    again = train_run(config)

    assert again.units == []
    assert again.started_from == f"checkpoint {first.units[-1].checkpoint_name}"
    assert (again.checkpoint, again.epoch, again.step, again.samples_seen, again.metrics) == (
        first.checkpoint,
        first.epoch,
        first.step,
        first.samples_seen,
        first.metrics,
    )


def test_larger_max_duration_continues_from_last_checkpoint(make_config, train_run):
    short = train_run(make_config(max_duration="2ep"))
    longer = train_run(make_config(max_duration="4ep"))
    reference = make_config(run_name="ref", max_duration="4ep")
    train_run(reference)

    assert [u.unit for u in longer.units] == [2, 3]
    assert longer.units[0].resumed_from.startswith(f"checkpoint {short.units[-1].checkpoint_name}")
    assert (longer.epoch, longer.samples_seen) == (4, 4 * 256)
    assert_same_weights(final_weights(make_config(max_duration="4ep")), final_weights(reference))


def test_load_path_with_weights_only_warm_starts_a_new_run(make_config, train_run):
    source = make_config(run_name="source")
    done = train_run(source)
    # lr=0 leaves the weights untouched, so the new run's weights must be exactly the loaded ones.
    tuned = make_config(
        run_name="tuned",
        max_duration="1ep",
        load_path=done.checkpoint,
        load_weights_only=True,
        recipe_args={"num_samples": 256, "lr": 0.0},
    )
    result = train_run(tuned)

    assert result.units[0].resumed_from == f"weights of {done.checkpoint} (load_path)"
    assert (result.epoch, result.step, result.samples_seen) == (1, 8, 256)  # progress starts anew
    assert_same_weights(final_weights(tuned), final_weights(source))


def test_retention_keeps_exactly_num_checkpoints_to_keep_including_latest(make_config, train_run):
    config = make_config(max_duration="5ep", num_checkpoints_to_keep=2)
    result = train_run(config)
    store = CheckpointStore(config.save_folder, config.run_name)

    names = [i.name for i in store.list()]
    assert names == [u.checkpoint_name for u in result.units[-2:]]
    assert store.read_pointer()["name"] == result.units[-1].checkpoint_name


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")
def test_failed_attempt_state_is_freed_before_the_retry(make_config):
    recipes_for_tests.BUILT_MODELS.clear()
    recipes_for_tests.ALIVE_AT_BUILD.clear()
    config = make_config(recipe="tests.recipes_for_tests:TrackingRecipe", max_duration="2ep", inject_fault_at_step=12)
    train(config)
    gc.collect()
    # Unit 0 built a model and kept it in memory; unit 1's first attempt reused it and failed. The retry
    # must build a fresh model (not reuse the failed attempt's), by which time the failed one was freed.
    assert len(recipes_for_tests.BUILT_MODELS) == 2
    assert recipes_for_tests.ALIVE_AT_BUILD == [[], [False]]
    # ... and the run, once it has ended, holds nothing of its session (its loader workers ended with it)
    assert [ref() for ref in recipes_for_tests.BUILT_MODELS] == [None, None]


def test_autoresume_false_refuses_an_existing_run_and_keeps_it(make_config, train_run):
    from training.config import ConfigError

    first = train_run(make_config(max_duration="1ep"))
    with pytest.raises(ConfigError, match="autoresume=False"):
        train_run(make_config(max_duration="2ep", autoresume=False))
    store = CheckpointStore(make_config().save_folder, "r")
    assert [i.name for i in store.list()] == [first.units[0].checkpoint_name]


def run_cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.train", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a python -m flows.train process (torch, Prefect) for each case
@pytest.mark.parametrize(
    "args, message",
    [
        (["--save_interval", "3x"], "error: save_interval='3x': use '<n>ep' (epochs), '<n>ba' (batches) or '<n>sp'"),
        (["--recipe", "no.such.module:Recipe"], "error: recipe='no.such.module:Recipe': cannot import"),
        (["--recipe_args", '{"hidden": -1}'], "error: recipe 'recipes.digits:DigitsRecipe' with recipe_args="),
    ],
)
def test_bad_config_fails_with_one_clear_error_and_writes_nothing(tmp_path, args, message):
    folder = tmp_path / "runs"
    proc = run_cli("--save_folder", str(folder), *args)
    assert proc.returncode == 2, proc.stderr
    # One line for the mistake, the last one. Before it, at most the note that the temporary Prefect server started
    # (it starts while torch and the recipe import: flows/launch.py), which the error stopped again.
    *before, last = proc.stderr.splitlines()
    assert last.startswith(message) and [line for line in before if "error" in line] == [], proc.stderr
    assert all(line.startswith("starting a temporary Prefect server") for line in before), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not folder.exists()
