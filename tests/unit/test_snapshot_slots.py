"""The training thread only copies (issue 45): a snapshot's buffers are made on the pipeline's ``snapshot-slots``
thread, the first as soon as a unit starts (``prepare``), and a snapshot whose buffer is still being made waits for
the rest of its making, counted apart from the copy, and is never skipped (what a run publishes does not depend on
timing). Allocation is made slow deterministically (held on an event), not by racing a sleep."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.commit.committer import CommitTerms
from checkpointing.commit.snapshots import SnapshotPipeline
from checkpointing.host_tier.tier import HostTier
from checkpointing.manifest import Writer

SECONDS = 60  # a bound for what must end at once; never reached unless something blocks


def take(pipeline: SnapshotPipeline, store: CheckpointStore, step: int, must_upload: bool = False):
    progress = {"epoch": 0, "step": step, "samples_seen": 32 * step, "sample_in_epoch": 32 * step}
    terms = CommitTerms(store, progress, Writer.current(0), {"metrics": {}, "within_unit": not must_upload})
    objects = {"state.pt": {"w": torch.full((256, 1024), float(step))}}  # 1 MB
    return pipeline.take(objects, terms, store.name_for(progress, 0), must_upload=must_upload)


def on_a_thread(call):
    """Runs ``call`` on a thread of its own: (its result, whether it returned within SECONDS)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(SECONDS)
    return (out[0] if out else None), not thread.is_alive()


def test_a_buffer_is_made_on_the_slot_thread_from_prepare_and_a_snapshot_waits_only_for_the_rest(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri, root=str(tmp_path / "tier")))
    gate, asked = threading.Event(), []
    pipeline.slots.before_make = lambda index, size: (asked.append(index), gate.wait(SECONDS))
    objects = {"state.pt": {"w": torch.zeros(256, 1024)}}
    try:
        caplog.set_level(logging.INFO, logger="checkpointing.commit.snapshots")
        _, returned = on_a_thread(lambda: pipeline.prepare(objects))
        assert returned, "prepare waited for the buffer it asked for"
        assert pipeline.slots.making == {0} and asked == [0]  # being made, on the slot thread
        _, returned = on_a_thread(lambda: pipeline.prepare(objects))
        assert returned and asked == [0]  # asked once: one buffer at a time

        # The first snapshot waits for the rest of the making, counted apart from the copy; it is never skipped.
        result: list = []
        first = threading.Thread(target=lambda: result.append(take(pipeline, store, 1)))
        first.start()
        first.join(0.5)
        assert first.is_alive()  # its buffer is still being made: it waits
        gate.set()
        first.join(SECONDS)
        (taken,) = result
        assert taken.waited > 0 and taken.copy_seconds > 0 and taken.seconds >= taken.waited + taken.copy_seconds
        assert pipeline.stats.wait_seconds_max == taken.waited and pipeline.stats.taken == 1
        assert sum("waited" in r.getMessage() for r in caplog.records) == 1
        pipeline._wait_published()
        assert [r.progress["step"] for _, r in pipeline.tier.records(0)] == [1]  # published
        assert pipeline.slots.wait_made(SECONDS)
        taken = take(pipeline, store, 9, must_upload=True)  # the second buffer was made after the first publish
        assert taken.waited == 0.0 and taken.pending.wait().name == "ep0-ba9-sa288"
        assert pipeline.stats.taken == 2
        assert set(pipeline.slots.made_on) and all(n.startswith("snapshot-slots") for n in pipeline.slots.made_on)
    finally:
        gate.set()
        pipeline.close()


def test_a_run_asks_for_its_first_buffer_before_its_first_snapshot(make_config, train_run, monkeypatch):
    """A run with a few MB of state and a snapshot every step, whose buffers take HOLD seconds to make once the first
    snapshot began: the first buffer is asked for before any snapshot (after the first optimizer step, once Adam's
    state exists, so it is sized for it: one making, never a second for a state that outgrew it), made on the slot
    thread, and every snapshot is taken, the first one's wait counted apart (snapshot_wait_seconds_max)."""
    hold = 1.0
    events: list[str] = []  # in the order the training thread saw them
    made: list[tuple[str, int]] = []  # (thread, slot index) of each making
    first_take = threading.Event()
    real_allocate, real_take, real_prepare = HostTier.allocate, SnapshotPipeline.take, SnapshotPipeline.prepare

    def slow_allocate(tier, index, size):
        made.append((threading.current_thread().name, index))
        first_take.wait(10)
        time.sleep(hold)
        return real_allocate(tier, index, size)

    def counting_take(pipeline, *args, **kwargs):
        events.append("take")
        first_take.set()
        return real_take(pipeline, *args, **kwargs)

    def noting_prepare(pipeline, objects):
        real_prepare(pipeline, objects)
        events.append(f"prepare (making {sorted(pipeline.slots.making)})")

    monkeypatch.setattr(HostTier, "allocate", slow_allocate)
    monkeypatch.setattr(SnapshotPipeline, "take", counting_take)
    monkeypatch.setattr(SnapshotPipeline, "prepare", noting_prepare)
    config = make_config(
        recipe_args={"num_samples": 256, "hidden": 512, "num_layers": 4},  # ~4 MB of weights, ~12 MB with Adam's
        max_duration="2ep",
        save_interval="1ep",
        snapshot_interval="1ba",
    )
    train_run(config)
    units = [i for i in CheckpointStore(config.save_folder, "r").list() if not i.manifest.metadata.get("within_unit")]
    metrics = [i.metrics for i in units]
    assert len(metrics) == 2 and all("snapshot_wait_seconds_max" in m for m in metrics)
    assert events[:2] == ["prepare (making [0])", "take"], events[:5]  # asked for before the first snapshot
    assert all(thread.startswith("snapshot-slots") for thread, _ in made), made
    indexes = [index for _, index in made]  # sized with Adam's state (after the first step): none made again larger
    assert len(indexes) == len(set(indexes)) <= 3, made
    assert metrics[0]["snapshot_wait_seconds_max"] > 0  # the first snapshot waited for the rest of its making
    assert metrics[0]["snapshot_seconds_max"] >= metrics[0]["snapshot_wait_seconds_max"]
    steps = 256 // config.global_batch_size  # every step of both units took its snapshot: none was skipped
    assert events.count("take") == 2 * steps, (events, steps)


@pytest.mark.parametrize("must_upload", [False, True])
def test_a_slot_thread_is_gone_when_the_pipeline_closes(tmp_path, must_upload):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, None)
    take(pipeline, store, 1, must_upload=must_upload)
    pipeline.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("snapshot-")]


def test_a_snapshot_that_waits_for_a_slot_that_cannot_be_made_fails_instead_of_waiting_for_ever(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, None)

    def no_memory(index, size):
        raise MemoryError("no room for a snapshot buffer")

    pipeline.slots.before_make = no_memory

    def unit_end() -> BaseException | None:
        try:
            take(pipeline, store, 1, must_upload=True)
        except MemoryError as exc:
            return exc
        return None

    try:
        raised, returned = on_a_thread(unit_end)
        assert returned, "a unit's snapshot waited for ever for a slot that cannot be made"
        assert raised is not None and "no room" in str(raised)
    finally:
        pipeline.close()


def test_a_unit_checkpoint_is_in_flight_from_the_moment_it_is_taken_not_only_once_published(tmp_path):
    """A next unit that starts while the last unit's checkpoint is still being published to the tier (checksummed
    and recorded, before its upload is queued) asks ``in_flight`` whether to go on from memory: it must get that
    checkpoint's name. It got None, so the unit threw its warm session away, waited for the upload and downloaded
    what it had in memory (found by test_store_faults once a unit's start got faster). Publication is held on an
    event here, not raced."""
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri, root=str(tmp_path / "tier")))
    gate, publishing = threading.Event(), threading.Event()
    record = pipeline._record

    def held(job):
        publishing.set()
        assert gate.wait(SECONDS)
        record(job)

    pipeline._record = held  # type: ignore[method-assign]
    try:
        take(pipeline, store, 3)  # inside a unit: uploaded only if it is the newest when the thread rests no more
        assert publishing.wait(SECONDS)
        assert pipeline.in_flight() is None  # not a checkpoint a next unit starts from
        gate.set()
        pipeline._wait_published()
        gate.clear()
        publishing.clear()
        taken = take(pipeline, store, 8, must_upload=True)  # a unit's last
        assert publishing.wait(SECONDS)
        assert pipeline.in_flight() == "ep0-ba8-sa256"  # while its publication is held
        gate.set()
        assert taken.pending.wait().name == "ep0-ba8-sa256"
        assert pipeline.in_flight() is None  # committed
    finally:
        gate.set()
        pipeline.close()
