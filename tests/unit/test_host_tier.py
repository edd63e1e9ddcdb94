"""The host-memory tier and the snapshot pipeline: a snapshot reaches this machine's memory and the store whole, a
retry or relaunch resumes from the newest one that verifies and belongs to the run's history, nothing of another run
or user is read, and nothing is left behind when the run completes."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.commit.committer import CommitTerms
from checkpointing.commit.snapshots import SnapshotPipeline
from checkpointing.errors import TierUnavailable
from checkpointing.host_tier.tier import STALE_SECONDS, HostTier, Record
from checkpointing.manifest import Writer
from training.config import ConfigError
from training.exceptions import InjectedFault
from training.run import Run, execute_unit
from training.start import host_memory
from training.sweep.study import TIMINGS  # the metrics that measure time (and skips), not training
from training.unit.loop import run_unit
from training.unit.warm import PROCESS

SNAPSHOTS = dict(max_duration="2ep", save_interval="1ep", snapshot_interval="1ba")  # 8 steps an epoch


def tier_files(config) -> list[str]:
    tier = HostTier(CheckpointStore(config.save_folder, config.run_name).uri)
    try:
        return sorted(os.listdir(tier.path))
    finally:
        tier.close()


def final_state(config) -> dict:
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest(), files=["state.pt"]).objects["state.pt"]["state"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def take(pipeline: SnapshotPipeline, store: CheckpointStore, objects: dict, step: int, must_upload: bool = True):
    progress = {"epoch": 0, "step": step, "samples_seen": 32 * step, "sample_in_epoch": 32 * step}
    terms = CommitTerms(store, progress, Writer.current(0), {"metrics": {}})
    return pipeline.take(objects, terms, store.name_for(progress, 0), must_upload=must_upload)


def test_on_the_cpu_a_step_waits_for_the_snapshot_before_it_to_be_published(tmp_path, monkeypatch):
    """A kill loses at most the step in progress: the optimizer step after a snapshot (before_step) returns only once
    that snapshot is published, however long its checksum and record take (held here on an event)."""
    import threading

    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri))
    gate, real_record = threading.Event(), SnapshotPipeline._record
    monkeypatch.setattr(SnapshotPipeline, "_record", lambda self, job: (gate.wait(60), real_record(self, job)))
    try:
        take(pipeline, store, {"state.pt": {"w": torch.ones(100)}}, 1, must_upload=False)
        step = threading.Thread(target=pipeline.before_step)
        step.start()
        step.join(0.5)
        assert step.is_alive()  # the snapshot of step 1 is not published yet: step 2 does not change the weights
        assert pipeline._newest is None
        gate.set()
        step.join(60)
        assert not step.is_alive() and pipeline._newest is not None and pipeline._newest.name == "ep0-ba1-sa32"
        pipeline.before_step()  # nothing in publication: returns at once
    finally:
        gate.set()
        pipeline.close()


def test_a_snapshot_reaches_the_tier_and_the_store_whole_with_tied_tensors_saved_once(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    tier = HostTier(store.uri)
    pipeline = SnapshotPipeline(store.uri, 0, tier)
    weight = torch.randn(64, 32)
    objects = {"state.pt": {"state": {"a": weight, "tied": weight, "n": 3, "lr": [0.1, (0.9, 0.99)]}}}
    was = weight.clone()
    taken = take(pipeline, store, objects, step=4)
    taken.pending.wait()
    weight.add_(1.0)  # training goes on: the snapshot holds the state as it was

    ((index, record),) = list(tier.records(0))
    loaded = tier.load(index, record, 0)
    assert torch.equal(loaded["state.pt"]["state"]["a"], was)
    assert loaded["state.pt"]["state"]["tied"] is loaded["state.pt"]["state"]["a"]
    assert loaded["state.pt"]["state"]["lr"] == [0.1, (0.9, 0.99)]
    committed = store.load(store.latest(), ["state.pt"]).objects["state.pt"]["state"]
    assert torch.equal(committed["a"], was) and committed["tied"] is committed["a"]
    assert store.latest().size_bytes < 2 * weight.numel() * 4  # the tied tensor's bytes once
    pipeline.close()


def test_the_tier_folder_is_private_and_its_files_are_the_users_alone(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri))
    take(pipeline, store, {"state.pt": {"w": torch.ones(8)}}, step=1).pending.wait()
    path = pipeline.usage.tier_path
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(os.path.join(path, f)).st_mode) for f in os.listdir(path)} == {0o600}
    pipeline.close()


def test_a_damaged_snapshot_is_never_loaded(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    tier = HostTier(store.uri)
    pipeline = SnapshotPipeline(store.uri, 0, tier)
    take(pipeline, store, {"state.pt": {"w": torch.zeros(1000)}}, step=1).pending.wait()
    ((index, record),) = list(tier.records(0))
    pipeline.close()
    tier = HostTier(store.uri)
    with open(os.path.join(tier.path, f"r0-s{index}.data"), "r+b") as f:
        f.seek(100)
        f.write(b"\x01")
    assert tier.load(index, record, 0) is None


def test_a_copy_never_goes_into_the_newest_snapshot_so_a_kill_mid_copy_leaves_it_whole(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri))
    for step in range(1, 8):
        before = pipeline._newest.slot.index if pipeline._newest is not None else None
        take(pipeline, store, {"state.pt": {"w": torch.full((100,), float(step))}}, step, must_upload=step % 3 == 0)
        pipeline._wait_published()
        assert pipeline._newest.slot.index != before
    assert len(pipeline.slots.slots) <= 3
    pipeline.close()


def unit_figures(config) -> list[dict[str, float]]:
    """The metrics each unit's checkpoint records, what depends on time left out."""
    infos = CheckpointStore(config.save_folder, config.run_name).list()
    ends = [i for i in infos if not i.manifest.metadata.get("within_unit")]
    return [{k: v for k, v in i.metrics.items() if k not in TIMINGS} for i in ends]


def test_a_retry_in_the_same_process_resumes_from_the_newest_snapshot_and_ends_bit_identical(make_config, train_run):
    reference = make_config(run_name="reference", **SNAPSHOTS)
    train_run(reference)
    config = make_config(inject_fault_at_step=5, **SNAPSHOTS)
    with Run.open(config) as run:
        with pytest.raises(InjectedFault):
            execute_unit(config, unit=0, generation=run.generation)
        retried = execute_unit(config, unit=0, attempt=2, generation=run.generation)
    assert retried.steps == 3  # steps 6, 7 and 8 of the epoch: nothing redone (from the store or from memory)
    assert retried.metrics["samples"] == 256.0  # the whole unit's, though resumed inside it
    train_run(config)
    assert_same_weights(final_state(config), final_state(reference))
    assert unit_figures(config) == unit_figures(reference)  # train_loss over all 8 steps, 256 samples, not 3 and 96
    assert tier_files(config) == []  # the run completed: its snapshots left this machine's memory


def test_a_snapshot_newer_than_the_stores_newest_is_resumed_from(make_config, train_run):
    reference = make_config(run_name="reference", **SNAPSHOTS)
    train_run(reference)
    config = make_config(**SNAPSHOTS)
    _stop_after_snapshot(config, 5)
    with Run.open(config) as run:
        resumed = execute_unit(config, unit=0, generation=run.generation)
    assert resumed.origin == "host" and resumed.resumed_from == "snapshot ep0-ba5-sa160 in this machine's memory"
    assert resumed.steps == 3
    train_run(config)
    assert_same_weights(final_state(config), final_state(reference))


def test_snapshots_change_nothing_that_is_trained(make_config, train_run):
    plain = make_config(run_name="plain", max_duration="2ep", save_interval="1ep")
    train_run(plain)
    snapshotted = make_config(run_name="snapshotted", **SNAPSHOTS)
    train_run(snapshotted)
    assert_same_weights(final_state(snapshotted), final_state(plain))
    names = [i.name for i in CheckpointStore(snapshotted.save_folder, "snapshotted").list()]
    assert names == ["ep1-ba8-sa256", "ep2-ba16-sa512"]  # the intermediate ones were superseded and deleted


def test_a_unit_checkpoint_the_store_never_got_is_committed_as_recorded_before_the_run_goes_on(make_config, train_run):
    """A kill after a unit's checkpoint reached this machine's memory but before its upload landed (the whole sweep
    SIGKILLed as a trial's segment ended, in CI): the relaunch found the run's end in the tier, trained a unit of 0
    steps from it and committed that unit's checkpoint again as 0 samples, train_loss 0 and no evaluation, so ASHA
    promoted another trial. The relaunch now commits the tier's unit checkpoint to the store as it was recorded, metrics
    and all, before the run decides where it stands; a segment that ended there has nothing left, a longer one goes on."""
    units = dict(save_interval="1ep", eval_each_unit=True)
    reference = make_config(run_name="reference", max_duration="2ep", **units)
    train_run(reference)
    config = _unit_end_only_in_memory(make_config(max_duration="2ep", **units))

    first_segment = config.model_copy(update={"max_duration": "1ep"})
    with Run.open(first_segment) as run:
        assert run.complete and run.started_from == "checkpoint ep1-ba8-sa256"
    assert unit_figures(config) == unit_figures(reference)[:1]  # 256 samples, its train_loss, its evaluation
    result = train_run(config)
    assert [u.unit for u in result.units] == [1] and result.units[0].origin == "store"  # the second unit only
    assert_same_weights(final_state(config), final_state(reference))
    assert unit_figures(config) == unit_figures(reference)


def _unit_end_only_in_memory(config):
    """Unit 0 trained and committed, then its checkpoint taken out of the store, as if its upload had not landed when
    the process died: only this machine's memory holds it."""
    with Run.open(config) as run:
        execute_unit(config, unit=0, generation=run.generation)
    store = CheckpointStore(config.save_folder, config.run_name)
    store.delete("ep1-ba8-sa256")
    assert store.latest() is None
    return config


def test_a_relaunch_refused_for_its_config_commits_nothing_from_memory_and_names_the_store(make_config):
    config = _unit_end_only_in_memory(make_config(max_duration="2ep"))
    changed = config.model_copy(update={"seed": 8})
    with pytest.raises(ConfigError) as refused:
        Run.open(changed)
    assert "host-memory" not in str(refused.value) and config.save_folder in str(refused.value), refused.value
    assert CheckpointStore(config.save_folder, config.run_name).list() == []  # refused before anything was written
    with Run.open(config) as run:  # the same config still resumes from it, once it is committed
        assert run.started_from == "checkpoint ep1-ba8-sa256"


@pytest.mark.parametrize("at_unit_end", [True, False], ids=["unit-end", "inside-a-unit"])
def test_autoresume_false_counts_what_only_this_machines_memory_holds_as_the_runs_checkpoints(make_config, at_unit_end):
    """autoresume=False on a run whose only checkpoint is in this machine's memory: refused without save_overwrite (as
    with one in the store), started over with it; before, the run resumed from memory as if autoresume were true."""
    if at_unit_end:
        config = _unit_end_only_in_memory(make_config(max_duration="2ep"))
    else:
        config = make_config(**SNAPSHOTS)
        _stop_after_snapshot(config, 5)
    store = CheckpointStore(config.save_folder, config.run_name)
    assert store.latest() is None and host_memory.newest_snapshot(config, store) is not None
    with pytest.raises(ConfigError, match="autoresume=False but run_name='r' already has checkpoints") as refused:
        Run.open(config.model_copy(update={"autoresume": False}))
    name = "ep1-ba8-sa256" if at_unit_end else "ep0-ba5-sa160"
    assert f"(its newest, {name}, in this machine's memory: its upload to {store.uri} did not land)" in str(
        refused.value
    )
    over = config.model_copy(update={"autoresume": False, "save_overwrite": True})
    with Run.open(over) as run:
        assert run.started_from == "no checkpoint"
        result = execute_unit(over, unit=0, generation=run.generation)
    assert result.origin == "fresh" and result.steps == 8


def _stop_after_snapshot(config, step: int):
    """Trains in this process until the snapshot of ``step`` is published, then drops the process's state as a killed
    process would lose it, and the snapshots inside the unit that reached the store, as if the kill came before
    their uploads landed: the tier holds what was published, the store its unit checkpoints."""
    with Run.open(config) as run:
        with pytest.raises(InjectedFault):
            run_unit(config.model_copy(update={"inject_fault_at_step": step}), generation=run.generation)
        PROCESS.committer.drop_snapshots()
        PROCESS.forget()
    store = CheckpointStore(config.save_folder, config.run_name)
    for info in store.list():
        if info.manifest.metadata.get("within_unit"):
            store.delete(info.name)


def test_a_snapshot_older_than_the_stores_newest_is_not_resumed_from(make_config):
    config = make_config(**SNAPSHOTS)
    _stop_after_snapshot(config, 5)
    store = CheckpointStore(config.save_folder, "r")
    assert host_memory.newest_snapshot(config, store).info.progress["step"] == 5
    elsewhere = config.model_copy(update={"host_memory_tier": False})  # another machine trained further
    with Run.open(elsewhere) as run:
        execute_unit(elsewhere, unit=0, generation=run.generation)
    assert host_memory.newest_snapshot(config, store) is None


def test_a_snapshot_is_not_resumed_from_once_a_newer_writer_committed(make_config):
    config = make_config(max_duration="3ep", save_interval="1ep", snapshot_interval="1ba")
    with Run.open(config) as run:
        execute_unit(config, unit=0, generation=run.generation)  # the store: step 8
    _stop_after_snapshot(config, 12)  # this machine's memory: step 12
    elsewhere = config.model_copy(update={"host_memory_tier": False, "save_interval": "2ba"})
    with Run.open(elsewhere) as run:  # another machine resumed from step 8 and committed step 10
        assert execute_unit(elsewhere, unit=4, generation=run.generation).progress["step"] == 10
    store = CheckpointStore(config.save_folder, "r")
    assert host_memory.newest_snapshot(config, store) is None


def test_a_snapshot_of_a_deleted_and_restarted_run_is_not_resumed_from(make_config, tmp_path):
    config = make_config(**SNAPSHOTS)
    _stop_after_snapshot(config, 5)
    shutil.rmtree(tmp_path / "runs")  # the user deleted the run; a new launch under the same name starts afresh
    with Run.open(config) as run:
        result = execute_unit(config, unit=0, generation=run.generation)
    assert result.origin == "fresh" and result.steps == 8


def test_a_roll_back_is_never_undone_by_a_snapshot(make_config):
    config = make_config(max_duration="3ep", save_interval="1ep", snapshot_interval="1ba")
    with Run.open(config) as run:
        execute_unit(config, unit=0, generation=run.generation)
    _stop_after_snapshot(config, 12)  # snapshot at step 12, store at step 8
    rolled = config.model_copy(update={"resume_from": "ep1-ba8-sa256"})
    with Run.open(rolled) as run:
        result = execute_unit(rolled, unit=1, generation=run.generation)
    assert result.origin == "store" and result.resumed_from == "checkpoint ep1-ba8-sa256"


def test_another_runs_snapshots_are_never_read(make_config):
    first = make_config(run_name="first", **SNAPSHOTS)
    _stop_after_snapshot(first, 5)
    second = make_config(run_name="second", **SNAPSHOTS)
    with Run.open(second) as run:
        result = execute_unit(second, unit=0, generation=run.generation)
    assert result.origin == "fresh"


def test_with_the_tier_off_nothing_is_written_to_shared_memory(make_config):
    config = make_config(host_memory_tier=False, inject_fault_at_step=5, **SNAPSHOTS)
    with Run.open(config) as run:
        with pytest.raises(InjectedFault):
            execute_unit(config, unit=0, generation=run.generation)
        assert tier_files(config) == []
        retried = execute_unit(config, unit=0, attempt=2, generation=run.generation)
    assert retried.origin == "store" and retried.steps == 3  # the snapshots still reach the store


def test_a_folder_planted_as_a_link_turns_the_tier_off(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", root / f"resumable-train-{os.getuid()}")
    with pytest.raises(TierUnavailable, match="without following a link"):
        HostTier("file:///runs/r", root=str(root))


def test_a_folder_others_may_enter_turns_the_tier_off(tmp_path):
    root = tmp_path / "shm"
    (root / f"resumable-train-{os.getuid()}").mkdir(parents=True, mode=0o777)
    os.chmod(root / f"resumable-train-{os.getuid()}", 0o777)
    with pytest.raises(TierUnavailable, match="not to this user"):
        HostTier("file:///runs/r", root=str(root))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (runuser)")
def test_another_user_can_neither_plant_the_folder_nor_read_a_snapshot(tmp_path, request):
    root = Path(tempfile.mkdtemp(prefix="shm-"))  # in /tmp, which every user may enter (pytest's folders are 0700)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    os.chmod(root, 0o1777)  # like /dev/shm: anyone may create, only the owner may remove
    planted = root / f"resumable-train-{os.getuid()}"
    subprocess.run(["runuser", "-u", "nobody", "--", "mkdir", "-m", "700", str(planted)], check=True)
    with pytest.raises(TierUnavailable, match="not to this user"):
        HostTier("file:///runs/r", root=str(root))

    subprocess.run(["runuser", "-u", "nobody", "--", "rmdir", str(planted)], check=True)
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    tier = HostTier(store.uri, root=str(root))
    pipeline = SnapshotPipeline(store.uri, 0, tier)
    take(pipeline, store, {"state.pt": {"w": torch.ones(8)}}, step=1).pending.wait()
    files = [os.path.join(tier.path, f) for f in os.listdir(tier.path)]
    for path in [tier.path, *files]:
        read = subprocess.run(["runuser", "-u", "nobody", "--", "cat", path], capture_output=True)
        assert read.returncode != 0
    pipeline.close()


def test_retention_counts_unit_checkpoints_not_the_snapshots_inside_units(make_config, train_run):
    config = make_config(max_duration="4ep", snapshot_interval="1ba", num_checkpoints_to_keep=2)
    train_run(config)
    names = [i.name for i in CheckpointStore(config.save_folder, "r").list()]
    assert names == ["ep3-ba24-sa768", "ep4-ba32-sa1024"]


def test_a_loop_of_its_own_gets_back_a_report_newer_than_the_stores_from_this_machines_memory(make_config):
    from checkpointing.commit.committer import Committer
    from training import LoopContext

    config = make_config(
        recipe="recipes.custom_loop:CustomLoopRecipe", recipe_args={"num_samples": 64}, max_duration="4ba"
    )
    store = CheckpointStore(config.save_folder, config.run_name)
    committer = Committer()
    ctx = LoopContext(config, store, committer=committer)
    ctx.get_checkpoint()
    for i in (1, 2):
        ctx.report({"loss": 0.5}, state={"model": {"w": torch.full((3,), float(i))}})
    committer.drop_snapshots()
    store.delete("ep0-ba2-sa0")  # the newest report's upload did not land before the kill (no samples: step counts)

    again = LoopContext(config, store, committer=Committer(), attempt=2)
    state = again.get_checkpoint()
    assert torch.equal(state["model"]["w"], torch.full((3,), 2.0))
    result = again.result(steps=0)
    assert result.origin == "host" and result.resumed_from == "snapshot ep0-ba2-sa0 in this machine's memory"
    committed = store.latest(deep=True)  # and the store has it again, as it was reported: a loop that ends here
    assert committed.name == "ep0-ba2-sa0" and committed.metrics == {"loss": 0.5}  # leaves it there, not nothing
    again._committer.drop_snapshots()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_only_buffers_in_memory_are_page_locked_for_cuda(tmp_path):
    """The kernel refuses a long-term pin of a disk file's pages: cudaHostRegister failed with 'invalid argument' on
    an H200, and the stale error then failed the next kernel. Buffers on disk are not pinned (one warning)."""
    in_memory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        assert HostTier("file:///r", root=in_memory).allocate(0, 4096).pinnable
    finally:
        shutil.rmtree(in_memory)
    elsewhere = HostTier("file:///r", root=str(tmp_path))  # a disk here and in CI; whatever it is, the rule holds
    assert elsewhere.allocate(0, 4096).pinnable == (elsewhere.filesystem in ("tmpfs", "hugetlbfs"))
    from checkpointing.host_tier.tier import Slot

    assert Slot.private(0, 4096).pinnable


def test_an_abandoned_runs_folder_is_swept_but_never_one_a_live_process_holds(tmp_path):
    old, held, fresh = (HostTier(f"file:///runs/{name}", root=str(tmp_path)) for name in ("old", "held", "fresh"))
    for tier in (old, held, fresh):
        record = Record("u0", {"samples_seen": 1}, {}, 1, 0, [], 0, "", "", tier.store_uri)
        tier.publish(tier.allocate(0, 4096), record, b"tree")
    day_ago = time.time() - STALE_SECONDS - 60
    for tier in (old, held):
        for entry in [*os.listdir(tier.path), "."]:
            os.utime(os.path.join(tier.path, entry), (day_ago, day_ago))
    old.close()
    fresh.close()  # closed but recent: a relaunch may still want it

    empty = HostTier("file:///runs/empty", root=str(tmp_path))
    empty.close()  # a run that failed before its first snapshot
    HostTier("file:///runs/new", root=str(tmp_path))  # opening any run's folder sweeps the others
    assert not os.path.exists(old.path) and not os.path.exists(empty.path)
    assert os.listdir(held.path) and os.listdir(fresh.path)


def test_a_record_past_the_cap_is_not_written_and_the_store_still_gets_the_snapshot(tmp_path, monkeypatch, caplog):
    """The tier's record and tree count against the per-user cap as its buffers do: with room for the buffer only,
    nothing of the record is written (so the user's snapshots stay under the cap), one warning says so, and the
    snapshot still reaches the store."""
    from checkpointing.host_tier.cap import CAP_ENV, used_bytes

    store = CheckpointStore(str(tmp_path / "runs"), "r")
    tier = HostTier(store.uri, root=str(tmp_path / "tier"))
    state = {"state.pt": {"w": torch.zeros(1000)}}  # 4 KB of data: a buffer of two 4 KB blocks
    monkeypatch.setenv(CAP_ENV, str(2 * 4096))
    pipeline = SnapshotPipeline(store.uri, 0, tier)
    try:
        with caplog.at_level(logging.WARNING, logger="checkpointing.commit.snapshots"):
            taken = take(pipeline, store, state, step=1)
            info = taken.pending.wait()
        assert info.name == "ep0-ba1-sa32" and store.latest().name == info.name  # the store got it
        assert list(tier.records(0)) == []  # no record past the cap ...
        assert used_bytes(tier._user_fd) <= 2 * 4096  # ... and nothing else of it
        assert [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()], caplog.text
    finally:
        pipeline.close()
