"""A stateful stream read by loader workers (num_workers=2, training/position/stream_workers.py): the saved position is
torchdata's StatefulDataLoader state, every worker's stream state in it; a run resumed from the store after each unit
trains what an uninterrupted one trains, its samples augmented with noise from the workers' own generators (torch,
random, numpy: seeded per sample, training/position/worker_seeds.py), a resume at another num_workers or world size is refused in one line with
nothing written, and a saved state of another shape is one DataError before any worker sees it."""

from __future__ import annotations

import sys

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from tests.stateful_iterable_recipes import write_json_rows
from tests.unit.test_stateful_iterable import latest, train_all
from training.config import ConfigError
from training.exceptions import DataError
from training.recipe.loader import allow_recipe
from training.unit.warm import PROCESS

pytest.importorskip("torchdata")
WORKERS = "tests.stream_worker_recipes:WorkerCountingStreamRecipe"


@pytest.fixture(autouse=True)
def _allowed():
    allow_recipe(WORKERS)


def stream_config(make_config, **overrides):
    values = dict(recipe=WORKERS, recipe_args={}, max_duration="8ba", save_interval="4ba", global_batch_size=8)
    return make_config(**{**values, "num_workers": 2, **overrides})


@pytest.mark.slow  # loader worker processes start (each ~10-25 s on 2 cores at load 10-20)
def test_workers_resumed_from_the_store_after_each_unit_train_what_an_uninterrupted_run_trains(make_config, train_run):
    warm, cold = stream_config(make_config, run_name="warm"), stream_config(make_config, run_name="cold")
    PROCESS.forget()
    assert [u.origin for u in train_run(warm).units] == ["fresh", "memory"]  # one process, the same workers
    train_all(cold)  # the second unit: new workers, from the saved loader state
    a, b = latest(warm), latest(cold)
    wa, wb = (x.objects[STATE_FILE]["state"]["model"] for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    saved = b.objects["rng-rank0.pt"]["data"]
    assert (saved["num_workers"], saved["world_size"]) == (2, 1)
    workers = saved["state"]["_snapshot"]["_worker_snapshots"]  # 64 samples, drawn in turn by the two workers
    seeded = {"stream": {"count": 32}, "samples": 32}  # the stream's own state, and the count its seeds come from
    assert [workers[f"worker_{i}"]["dataset_state"] for i in (0, 1)] == [seeded, seeded]
    assert b.info.progress["samples_seen"] == 64


@pytest.mark.slow  # loader worker processes start (each ~10-25 s on 2 cores at load 10-20)
def test_a_changed_num_workers_is_refused_in_one_line_and_nothing_is_written(make_config):
    config = stream_config(make_config, max_duration="4ba")
    train_all(config)
    store = CheckpointStore(config.save_folder, config.run_name)
    before = store.latest().name
    for changed, text in ((0, "num_workers=2 -> 0"), (3, "num_workers=2 -> 3")):
        with pytest.raises(ConfigError) as caught:
            train_all(stream_config(make_config, num_workers=changed))
        message = str(caught.value)
        assert "\n" not in message and message.startswith(text) and "ShardedDataset" in message
    assert store.latest().name == before and [c.name for c in store.list()] == [before]


def test_a_changed_num_workers_is_refused_naming_the_option_before_any_worker_starts():
    from tests.stream_worker_recipes import WorkerCountingStream
    from training.position.iterable import StatefulIterable

    saved = {"state": _loader_state(), "world_size": 1, "global_batch_size": 8, "num_workers": 2}
    in_process = StatefulIterable(WorkerCountingStream(seed=1, rank=0, in_features=4, num_classes=2))
    with pytest.raises(ConfigError, match=r"^num_workers=2 -> 0: checkpoint c saved .*ShardedDataset") as caught:
        in_process.restore(saved, 1, 8, 0, "checkpoint c")
    assert "\n" not in str(caught.value) and in_process.stream.count == 0  # nothing loaded
    three = StatefulIterable(WorkerCountingStream(seed=1, rank=0, in_features=4, num_classes=2))
    three.read_with_workers(3, seed=1, samples_per_step=4)
    with pytest.raises(ConfigError, match=r"^num_workers=2 -> 3: "):
        three.restore(saved, 1, 8, 3, "checkpoint c")
    assert three.workers._iterator is None and three.workers.next_iter_state is None  # no worker, nothing loaded


def test_a_changed_world_size_is_refused_naming_the_option():
    from tests.stream_worker_recipes import WorkerCountingStream
    from training.position.iterable import StatefulIterable

    stream = StatefulIterable(WorkerCountingStream(seed=1, rank=0, in_features=4, num_classes=2))
    stream.read_with_workers(2, seed=1, samples_per_step=4)
    saved = {"state": _loader_state(), "world_size": 2, "global_batch_size": 8, "num_workers": 2}
    with pytest.raises(ConfigError, match=r"^world_size=2 -> 1: checkpoint c saved .*ShardedDataset") as caught:
        stream.restore(saved, 1, 8, 2, "checkpoint c")
    assert "\n" not in str(caught.value)


def test_workers_without_torchdata_installed_are_one_line_naming_the_extra(make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)  # as if it were not installed
    config = stream_config(make_config)
    with pytest.raises(ConfigError, match=r"^num_workers=2: .*not installed; pip install 'resumable-train\[streams\]'"):
        train_all(config)
    assert CheckpointStore(config.save_folder, config.run_name).latest() is None


def _loader_state(workers: int = 2) -> dict:
    """A StatefulDataLoader state as worker_loader writes it (the shape test_workers_... reads back from a run)."""
    worker = {
        "dataset_state": {"stream": {"count": 3}, "samples": 3},
        "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
    }
    return {
        "_snapshot": {
            "_snapshot_step": 6,
            "_last_yielded_worker_id": 1,
            "_main_snapshot": {"_num_workers": workers, "_base_seed": 5, "_shared_seed": None},
            "_worker_snapshots": {f"worker_{i}": {**worker, "worker_id": i} for i in range(workers)},
        },
        "_steps_since_snapshot": 0,
        "_iterator_finished": False,
    }


def _forged(change) -> dict:
    state = _loader_state()
    change(state)
    return state


FORGED = {
    "three workers' snapshots": _loader_state(3),
    "samples to replay": _forged(lambda s: s.update(_steps_since_snapshot=10**12)),
    "a missing worker": _forged(lambda s: s["_snapshot"]["_worker_snapshots"].pop("worker_1")),
    "a worker named twice": _forged(lambda s: s["_snapshot"]["_worker_snapshots"]["worker_1"].update(worker_id=0)),
    "an extra key": _forged(lambda s: s.update(extra=1)),
    "a non-string key": _forged(lambda s: s["_snapshot"]["_main_snapshot"].update({3: 1})),
    "a deep nest": _forged(lambda s: s["_snapshot"]["_main_snapshot"].update(deep=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])),
    "not a dict": [1, 2],
    "a worker's state without its sample count": _forged(
        lambda s: s["_snapshot"]["_worker_snapshots"]["worker_0"].update(dataset_state={"count": 3})),
    "a negative sample count": _forged(
        lambda s: s["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"].update(samples=-1)),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(FORGED))
def test_a_saved_loader_state_of_another_shape_is_one_data_error_before_any_worker_starts(what):
    from tests.stream_worker_recipes import WorkerCountingStream
    from training.position.iterable import StatefulIterable

    stream = StatefulIterable(WorkerCountingStream(seed=1, rank=0, in_features=4, num_classes=2))
    stream.read_with_workers(2, seed=1, samples_per_step=4)
    stream.restore({"state": _loader_state(), "world_size": 1, "global_batch_size": 8, "num_workers": 2}, 1, 8, 2, "c")
    saved = {"state": FORGED[what], "world_size": 1, "global_batch_size": 8, "num_workers": 2}
    with pytest.raises(DataError, match=r"^checkpoint c: this rank's stream state .* num_workers=2: ") as caught:
        stream.restore(saved, 1, 8, 2, "checkpoint c")
    assert "\n" not in str(caught.value)
    assert stream.workers._iterator is None  # no worker was started for it


@pytest.mark.slow  # loader worker processes start (each ~10-25 s on 2 cores at load 10-20)
def test_an_augmented_hugging_face_streaming_dataset_read_by_two_workers_resumes_exactly(
    make_config, train_run, tmp_path
):
    pytest.importorskip("datasets")
    # 4 files of 20 rows, 2 a worker: 2 units of 4 steps of 8 (32 rows a worker) cross a file end
    files = write_json_rows(tmp_path, files=4, rows=20)
    recipe, args = "tests.stateful_iterable_recipes:JsonStreamRecipe", {"data_files": files, "augment": True}
    allow_recipe(recipe)
    warm = stream_config(make_config, run_name="warm", recipe=recipe, recipe_args=args)
    cold = stream_config(make_config, run_name="cold", recipe=recipe, recipe_args=args)
    PROCESS.forget()
    train_run(warm)
    train_all(cold)
    a, b = latest(warm), latest(cold)
    wa, wb = (x.objects[STATE_FILE]["state"]["model"] for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    workers = b.objects["rng-rank0.pt"]["data"]["state"]["_snapshot"]["_worker_snapshots"]
    states = [workers[f"worker_{i}"]["dataset_state"]["stream"] for i in (0, 1)]  # Hugging Face's own, one a worker
    assert [s["examples_iterable"]["previous_state_example_idx"] for s in states] == [32, 32]  # 64 samples in turn
