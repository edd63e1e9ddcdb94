"""The training thread only copies (issue 45): a snapshot's buffers are made on the pipeline's ``snapshot-slots``
thread, a snapshot inside a unit whose buffer is not ready is skipped and counted (never waited for), and a unit's
checkpoint, which must reach the store, waits for one with the wait counted apart from the copy. Allocation is made
slow deterministically (held on an event), not by racing a sleep."""

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


def test_a_snapshot_whose_buffer_is_not_ready_is_skipped_and_counted_never_waited_for(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri, root=str(tmp_path / "tier")))
    gate, asked = threading.Event(), []
    pipeline.slots.before_make = lambda index, size: (asked.append(index), gate.wait(SECONDS))
    try:
        caplog.set_level(logging.INFO, logger="checkpointing.commit.snapshots")
        for step in (1, 2, 3):
            taken, returned = on_a_thread(lambda step=step: take(pipeline, store, step))
            assert returned, "a snapshot waited for a buffer being made"
            assert taken.skipped and taken.copy_seconds == 0.0 and taken.waited == 0.0
        assert pipeline.stats.skipped == 3 and pipeline.stats.taken == 0
        assert sum("skipped" in r.getMessage() for r in caplog.records) == 1  # logged once
        assert asked == [0]  # the first buffer is being made (one slot thread: the second waits behind it)
        assert list(pipeline.tier.records(0)) == []  # nothing was published

        # A unit's checkpoint must reach the store: it waits for its buffer, and the wait is counted apart.
        result: list = []
        unit_end = threading.Thread(target=lambda: result.append(take(pipeline, store, 8, must_upload=True)))
        unit_end.start()
        unit_end.join(0.5)
        assert unit_end.is_alive()  # its buffer is still being made: it waits
        gate.set()
        unit_end.join(SECONDS)
        (taken,) = result
        assert not taken.skipped and taken.waited > 0 and taken.pending.wait().name == "ep0-ba8-sa256"
        assert pipeline.stats.wait_seconds_max == taken.waited
        assert pipeline.slots.wait_made(SECONDS)
        taken = take(pipeline, store, 9)  # buffers made: copied
        assert not taken.skipped and taken.copy_seconds > 0 and pipeline.stats.taken == 2
        assert set(pipeline.slots.made_on) and all(n.startswith("snapshot-slots") for n in pipeline.slots.made_on)
    finally:
        gate.set()
        pipeline.close()


def test_the_longest_stall_of_a_run_excludes_making_the_buffers(make_config, train_run, monkeypatch, tmp_path):
    """A run with a few MB of state and a snapshot every step, whose buffers take at least HOLD seconds to make
    (held until the third snapshot was taken, and that long at least): no snapshot's stall includes that, the ones
    taken meanwhile are skipped and counted in the unit's figures, none waited."""
    hold = 1.0
    made_on: list[str] = []
    third = threading.Event()
    real_allocate, real_take = HostTier.allocate, SnapshotPipeline.take
    takes = [0]

    def slow_allocate(tier, index, size):
        started = time.monotonic()
        made_on.append(threading.current_thread().name)
        third.wait(10)
        time.sleep(max(0.0, hold - (time.monotonic() - started)))
        return real_allocate(tier, index, size)

    def counting_take(pipeline, *args, **kwargs):
        takes[0] += 1
        if takes[0] == 3:
            third.set()
        return real_take(pipeline, *args, **kwargs)

    monkeypatch.setattr(HostTier, "allocate", slow_allocate)
    monkeypatch.setattr(SnapshotPipeline, "take", counting_take)
    config = make_config(
        recipe_args={"num_samples": 256, "hidden": 512, "num_layers": 4},  # ~4 MB of weights, ~12 MB with Adam's
        max_duration="2ep",
        save_interval="1ep",
        snapshot_interval="1ba",
    )
    train_run(config)
    units = [i for i in CheckpointStore(config.save_folder, "r").list() if not i.manifest.metadata.get("within_unit")]
    metrics = [i.metrics for i in units]
    assert len(metrics) == 2 and all("snapshot_seconds_max" in m for m in metrics)
    assert max(m["snapshot_seconds_max"] for m in metrics) < hold  # no stall made a buffer
    assert sum(m["snapshots_skipped"] for m in metrics) >= 2  # the first two at least: their buffers were held
    assert all(m["snapshot_wait_seconds_max"] == 0.0 for m in metrics)  # a snapshot inside a unit never waits
    assert made_on and all(n.startswith("snapshot-slots") for n in made_on), made_on


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
