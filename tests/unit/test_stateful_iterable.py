"""A stateful IterableDataset (training/position/iterable.py): each rank's stream state is saved beside its RNG state in
every checkpoint, restored at resume (bit-identical weights), and a resume at another topology is refused in one line."""

from __future__ import annotations

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from training.config import ConfigError
from training.recipe.loader import allow_recipe
from training.unit.loop import run_unit
from training.unit.warm import PROCESS

COUNTING = "tests.stateful_iterable_recipes:CountingStreamRecipe"


@pytest.fixture(autouse=True)
def _allowed():
    allow_recipe(COUNTING)
    allow_recipe("tests.stateful_iterable_recipes:JsonStreamRecipe")


def stream_config(make_config, **overrides):
    values = dict(recipe=COUNTING, recipe_args={}, max_duration="12ba", save_interval="4ba", global_batch_size=8)
    return make_config(**{**values, **overrides})


def train_all(config, cold: bool = True) -> None:
    """Every unit, each resumed from the store as in a new process (without start_checkpoint no warm state is used)."""
    PROCESS.forget()
    while not run_unit(config).complete:
        PROCESS.forget()
    PROCESS.forget()


def latest(config):
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest().name, files=[STATE_FILE, "rng-rank0.pt"])


def assert_same_weights(a, b) -> None:
    wa, wb = (x.objects[STATE_FILE]["state"]["model"] for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_stateful_stream_resumed_after_each_unit_trains_what_an_uninterrupted_run_trains(make_config, train_run):
    warm = stream_config(make_config, run_name="warm")
    cold = stream_config(make_config, run_name="cold")
    PROCESS.forget()
    assert [u.origin for u in train_run(warm).units] == ["fresh", "memory", "memory"]  # one process, uninterrupted
    train_all(cold, cold=True)
    a, b = latest(warm), latest(cold)
    assert_same_weights(a, b)
    saved = b.objects["rng-rank0.pt"]["data"]  # the stream's position, beside the rank's RNG state
    assert saved == {"state": {"count": 96}, "world_size": 1, "global_batch_size": 8, "num_workers": 0}
    assert b.info.progress["samples_seen"] == 96


def test_a_changed_global_batch_size_is_refused_in_one_line_and_nothing_is_written(make_config):
    config = stream_config(make_config, max_duration="4ba")
    train_all(config, cold=True)
    before = CheckpointStore(config.save_folder, config.run_name).latest().name
    changed = stream_config(make_config, global_batch_size=16)
    with pytest.raises(ConfigError) as caught:
        train_all(changed, cold=True)
    message = str(caught.value)
    assert "\n" not in message and "global_batch_size=8 -> 16" in message and "ShardedDataset" in message
    assert CheckpointStore(config.save_folder, config.run_name).latest().name == before


def test_a_stream_without_len_has_no_epochs(make_config):
    with pytest.raises(ConfigError, match=r"^max_duration=2ep: .*CountingStream, a stream without len\(\)"):
        train_all(stream_config(make_config, max_duration="2ep"), cold=True)


def test_a_hugging_face_streaming_dataset_over_local_jsonl_resumes_exactly(make_config, train_run, tmp_path):
    pytest.importorskip("datasets")
    import json

    g = torch.Generator().manual_seed(3)
    files = []
    for f in range(3):  # 3 files of 40 rows: 120 rows, a run of 10 steps of 8 crosses file boundaries
        path = tmp_path / f"part-{f}.jsonl"
        x = torch.randn(40, 16, generator=g)
        rows = [{"x": row.tolist(), "y": int(row[:4].argmax())} for row in x]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(path))
    recipe = "tests.stateful_iterable_recipes:JsonStreamRecipe"
    args = {"data_files": files}
    warm = stream_config(make_config, run_name="warm", recipe=recipe, recipe_args=args, max_duration="10ba")
    cold = stream_config(make_config, run_name="cold", recipe=recipe, recipe_args=args, max_duration="10ba")
    PROCESS.forget()
    train_run(warm)
    train_all(cold)
    a, b = latest(warm), latest(cold)
    assert_same_weights(a, b)
    saved = b.objects["rng-rank0.pt"]["data"]["state"]  # Hugging Face's own state: 80 rows read
    assert saved["examples_iterable"]["previous_state_example_idx"] == 80 == b.info.progress["samples_seen"]


def test_a_changed_world_size_or_a_rank_without_state_is_refused_naming_sharded_dataset():
    from tests.stateful_iterable_recipes import CountingStream
    from training.position.iterable import StatefulIterable

    stream = StatefulIterable(CountingStream(seed=1, rank=0, in_features=4, num_classes=2))
    stream.__getitems__([0, 1, 2])
    saved = stream.capture(world_size=2, global_batch_size=8, num_workers=0)  # as a 2-process run saved rank 0's
    with pytest.raises(ConfigError, match=r"^world_size=2 -> 1: checkpoint c saved .*ShardedDataset"):
        stream.restore(saved, 1, 8, 0, "checkpoint c")
    with pytest.raises(ConfigError, match=r"^checkpoint c has no stream state for this rank \(world_size=3\).*Sharded"):
        stream.restore(None, 3, 8, 0, "checkpoint c")  # the world grew: this rank saved nothing
    fresh = StatefulIterable(CountingStream(seed=1, rank=0, in_features=4, num_classes=2))
    fresh.restore(saved, 2, 8, 0, "checkpoint c")
    assert torch.equal(fresh[0]["x"], stream[0]["x"])  # both go on at sample 3
