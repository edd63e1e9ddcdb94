"""One commit engine (issue 45): every checkpoint a process commits in the background goes through the snapshot
pipeline's one upload thread (checkpointing/commit/snapshots.py), in order with its snapshots — also a state the
host buffers cannot copy (a sparse tensor), which is serialized on the training thread and handed to that thread."""

from __future__ import annotations

import threading

import torch

from training.start.store import open_store

SPARSE = "tests.recipes_for_tests:SparseBufferRecipe"


def _upload_threads() -> set[str]:
    return {t.name.rsplit("_", 1)[0] for t in threading.enumerate() if "upload" in t.name}


def test_a_state_snapshots_cannot_copy_commits_in_the_background_on_the_one_upload_thread(make_config, train_run):
    seen: set[str] = set()
    config = make_config(recipe=SPARSE, max_duration="3ep", async_upload=True, snapshot_interval="3ba")
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            seen.update(_upload_threads())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = train_run(config)
    finally:
        done.set()
        watcher.join()
    assert [u.unit for u in result.units] == [0, 1, 2]
    assert seen == {"snapshot-upload"}, f"commit threads seen: {seen}"
    store = open_store(config)
    names = [i.name for i in store.list()]
    assert result.checkpoint_name in names
    state = store.load(result.checkpoint_name).objects["state.pt"]["state"]["model"]
    assert state["mask"].is_sparse and torch.equal(state["mask"].to_dense(), torch.eye(4))
    again = train_run(make_config(recipe=SPARSE, max_duration="4ep", async_upload=True, snapshot_interval="3ba"))
    assert again.started_from == f"checkpoint {result.checkpoint_name}"
