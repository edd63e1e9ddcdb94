"""A run ends every thread it started, on every path (issue 45): the snapshot engine's (``snapshot-publish``,
``snapshot-upload``, ``snapshot-slots``) and TensorBoard's writer, whether the run completed, failed or was
preempted. ``train(config)`` from Python, a notebook or a sweep's warm runner runs many runs in one process: a failed
run used to leave its three snapshot threads, their state-sized buffers and its writer thread behind for ever. The
host-memory tier's files of a run that did not complete stay (a relaunch here resumes from them)."""

from __future__ import annotations

import threading

import pytest

from checkpointing import CheckpointStore
from checkpointing.host_tier.tier import HostTier
from training import preemption
from training.exceptions import InjectedFault
from training.preemption import STOP, Preempted
from training.run import Run, execute_unit

SIGNALLED = "tests.recipes_for_tests:SignalledRecipe"


def run_threads() -> list[str]:
    """The threads a run may start that are still alive: the snapshot engine's and TensorBoard's writer (named
    ``Thread-N`` by TensorBoard: called ``tensorboard-writer`` here)."""
    found = []
    for t in threading.enumerate():
        if t.name.startswith("snapshot-"):
            found.append(t.name)
        elif type(t).__name__ == "_AsyncWriterThread":
            found.append("tensorboard-writer")
    return sorted(found)


def train_to_end(config, seen: list[str]) -> Run:
    """What the train flow does, without Prefect: open the run, train units until it is complete; ``seen`` gets the
    threads running after each unit (so that the test sees it had something to end)."""
    with preemption.handling(config.preemption_signals), Run.open(config) as run:
        while not run.complete:
            preemption.raise_if_requested(run.head, run.progress.step)
            run.record(execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation))
            seen.extend(run_threads())
        return run


@pytest.fixture(autouse=True)
def _no_stop_request_left():
    STOP.clear()
    yield
    STOP.clear()


@pytest.mark.parametrize("ending", ["completed", "failed", "preempted"])
def test_no_thread_of_a_run_outlives_it(make_config, tmp_path, ending):
    assert run_threads() == []
    options = {"snapshot_interval": "2ba", "max_duration": "2ep", "unit_retries": 0}
    if ending == "failed":
        options["inject_fault_at_step"] = 11  # in unit 1
    if ending == "preempted":
        recipe_args = {"num_samples": 256, "record_dir": str(tmp_path / "ids"), "signal_at_step": 11}
        options.update(recipe=SIGNALLED, recipe_args=recipe_args)
    config = make_config(**options)
    seen: list[str] = []

    if ending == "completed":
        train_to_end(config, seen)
    else:
        with pytest.raises(InjectedFault if ending == "failed" else Preempted):
            train_to_end(config, seen)

    started = {"snapshot-publish_0", "snapshot-upload_0", "snapshot-slots_0", "tensorboard-writer"}
    assert started <= set(seen), seen  # they ran while the run trained
    assert run_threads() == [], ending
    store = CheckpointStore(config.save_folder, config.run_name)
    tier = HostTier(store.uri)
    try:
        assert bool(list(tier.records(0))) == (ending != "completed")  # kept for a relaunch here, unless complete
    finally:
        tier.close()


def test_the_process_state_reset_closes_a_pipeline_that_no_run_owns(tmp_path):
    """A unit attempted outside a run (a committer of its own, as several unit tests make) leaves its pipeline open
    after the unit: the one reset (between tests, between a warm runner's segments) closes it, and its threads end.
    Before, they lived until a garbage collection, and this module's first assertion failed after such a test."""
    import torch

    from checkpointing.commit.committer import CommitTerms
    from checkpointing.commit.snapshots import SnapshotPipeline
    from checkpointing.manifest import Writer
    from training import process_state

    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri))  # held here: no collection can close it
    progress = {"epoch": 0, "step": 1, "samples_seen": 32, "sample_in_epoch": 32}
    terms = CommitTerms(store, progress, Writer.current(0), {"metrics": {}})
    pipeline.take({"state.pt": {"w": torch.ones(100)}}, terms, "ep0-ba1-sa32", must_upload=True).pending.wait()
    assert {"snapshot-publish_0", "snapshot-upload_0"} <= set(run_threads())
    process_state.reset()
    assert run_threads() == []
    assert pipeline._closed
    HostTier(store.uri).remove()
