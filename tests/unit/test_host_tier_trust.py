"""What the host-memory tier trusts, and what it holds: a record is used only when its own checksum covers every field
(progress, generation, the claim) and the position in its snapshot's tree is the one it gives; one user's snapshots
are capped; a missing TRAIN_HOST_TIER_DIR is made private; opening a pipeline sweeps the folders no relaunch would
resume from, never a live run's."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat

import pytest

from checkpointing import CheckpointStore
from checkpointing.errors import TierUnavailable
from checkpointing.host_tier import cap
from checkpointing.host_tier.cap import TierFull
from checkpointing.host_tier.gc import RESUMABLE, sweep, sweep_on_open
from checkpointing.host_tier.tier import HostTier, Record, _fields_checksum, run_key
from tests.unit.test_host_tier import SNAPSHOTS, _stop_after_snapshot, assert_same_weights, final_state
from training.run import Run, execute_unit
from training.start import host_memory

CLAIM = {"claimed_at": 1.5, "host": "h", "pid": 7}


def _published(tier: HostTier) -> None:
    record = Record("ep0-ba128-sa2048", {"samples_seen": 2048, "step": 128}, {"claim": CLAIM}, 3, 0, [], 0, "x", "x",
                    tier.store_uri)  # fmt: skip
    tier.publish(tier.allocate(0, 4096), record, b"tree")


def _rewrite(tier: HostTier, slot: int, change, keep_checksum_valid: bool = False) -> None:
    path = os.path.join(tier.path, f"r0-s{slot}.json")
    with open(path) as f:
        raw = json.load(f)
    change(raw)
    if keep_checksum_valid:  # a forgery made whole: the record agrees with itself
        raw.pop("record_xxh")
        raw["record_xxh"] = _fields_checksum(raw)
    with open(path, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["progress"].update(samples_seen=3072),  # 2048 with one bit set: the relaunch skipped 1024 samples
        lambda r: r.update(generation=7),
        lambda r: r["metadata"]["claim"].update(pid=15),
    ],
    ids=["samples_seen", "generation", "claim"],
)
def test_a_bit_set_in_any_field_of_a_record_means_its_slot_is_not_used(tmp_path, caplog, change):
    tier = HostTier("file:///runs/k", root=str(tmp_path))
    _published(tier)
    assert [r.progress["samples_seen"] for _, r in tier.records(0)] == [2048]
    _rewrite(tier, 0, change)
    with caplog.at_level(logging.WARNING):
        assert list(tier.records(0)) == []
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["host-memory tier: slot 0 of rank 0 is damaged (its fields do not match the record's checksum); "
                     "not used"]  # fmt: skip
    tier.close()


def test_a_flipped_bit_in_the_newest_record_is_not_resumed_from_and_the_run_ends_exact(make_config, train_run, caplog):
    to_samples = {**SNAPSHOTS, "max_duration": "512sp"}  # a samples_seen believed would end the run elsewhere
    reference = make_config(run_name="reference", **to_samples)
    train_run(reference)
    config = make_config(**to_samples)
    _stop_after_snapshot(config, 5)
    store = CheckpointStore(config.save_folder, config.run_name)
    tier = HostTier(store.uri)
    newest = max(tier.records(0), key=lambda r: r[1].seq)[0]
    _rewrite(tier, newest, lambda r: r["progress"].update(samples_seen=160 | 256))  # one bit set: 96 samples skipped
    tier.close()
    with caplog.at_level(logging.WARNING), Run.open(config) as run:
        resumed = execute_unit(config, unit=0, generation=run.generation)
    assert f"slot {newest} of rank 0 is damaged" in caplog.text
    assert resumed.resumed_from != "snapshot ep0-ba5-sa160 in this machine's memory"
    assert resumed.progress["samples_seen"] == 256  # the unit's end, with no sample skipped
    train_run(config)
    assert_same_weights(final_state(config), final_state(reference))


def test_a_record_forged_whole_that_disagrees_with_its_snapshot_is_not_used(make_config, caplog):
    config = make_config(**SNAPSHOTS)
    _stop_after_snapshot(config, 5)
    store = CheckpointStore(config.save_folder, config.run_name)
    tier = HostTier(store.uri)
    newest = max(tier.records(0), key=lambda r: r[1].seq)[0]
    _rewrite(tier, newest, lambda r: r["progress"].update(samples_seen=3072), keep_checksum_valid=True)
    tier.close()
    with caplog.at_level(logging.WARNING):
        found = host_memory.newest_snapshot(config, store)
    assert found is None or found.info.progress["samples_seen"] != 3072
    assert f"slot {newest} of rank 0 (ep0-ba5-sa160) records a position its snapshot does not hold" in caplog.text


def test_one_users_snapshots_are_capped_and_the_next_buffer_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(cap.CAP_ENV, "16K")
    first, second = HostTier("file:///runs/a", root=str(tmp_path)), HostTier("file:///runs/b", root=str(tmp_path))
    first.allocate(0, 8192)
    before = cap.skipped_over_cap
    with pytest.raises(TierFull, match=r"past the cap .*TRAIN_HOST_TIER_MAX_BYTES"):
        second.allocate(0, 12288)
    assert cap.skipped_over_cap == before + 1
    assert os.listdir(second.path) == []  # nothing reserved
    second.allocate(0, 4096)  # what still fits is taken
    first.close()
    second.close()


@pytest.mark.parametrize("value", ["lots", "-5", "0%", "150%"])
def test_a_cap_that_is_not_a_size_is_one_line_naming_the_variable(tmp_path, monkeypatch, value):
    monkeypatch.setenv(cap.CAP_ENV, value)
    tier = HostTier("file:///runs/a", root=str(tmp_path))
    with pytest.raises(TierUnavailable, match=rf"^TRAIN_HOST_TIER_MAX_BYTES='{value}' is not a size: "):
        tier.allocate(0, 4096)
    tier.close()


def test_the_default_cap_leaves_most_of_the_file_system_free(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        st = os.fstatvfs(fd)
        assert cap.cap_bytes(fd) == int(st.f_blocks * st.f_frsize * 0.25)
    finally:
        os.close(fd)


def test_a_tier_folder_that_does_not_exist_yet_is_made_private(tmp_path, monkeypatch):
    root = tmp_path / "not" / "yet"
    monkeypatch.setenv("TRAIN_HOST_TIER_DIR", str(root))
    tier = HostTier("file:///runs/a")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert tier.path.startswith(str(root))
    tier.close()


def test_opening_a_pipeline_sweeps_what_no_relaunch_would_resume_from_but_never_a_live_run(make_config, tmp_path):
    killed = make_config(run_name="killed", **SNAPSHOTS)
    _stop_after_snapshot(killed, 5)  # a relaunch here would resume from it: kept
    deleted = make_config(run_name="deleted", save_folder=str(tmp_path / "gone"), **SNAPSHOTS)
    _stop_after_snapshot(deleted, 5)
    live = make_config(run_name="live", save_folder=str(tmp_path / "live"), **SNAPSHOTS)
    _stop_after_snapshot(live, 5)
    shutil.rmtree(tmp_path / "gone")  # its store is gone: nothing will resume from it
    held = HostTier(CheckpointStore(live.save_folder, "live").uri)  # a process holds it open
    shutil.rmtree(tmp_path / "live")  # even a live run whose store went is left alone
    stores = {name: CheckpointStore(c.save_folder, name).uri for name, c in
              (("killed", killed), ("deleted", deleted), ("live", live))}  # fmt: skip
    found = {f.store_uri or f.key: f for f in sweep(None, lambda f: False)}
    assert found[stores["killed"]].why == RESUMABLE
    assert found[stores["deleted"]].why.startswith("its store ") and found[stores["deleted"]].why.endswith("is gone")

    opener = HostTier(CheckpointStore(str(tmp_path / "other"), "new").uri)
    sweep_on_open(opener)
    left = {f.key for f in sweep(None, lambda f: False)}
    assert run_key(stores["deleted"]) not in left and run_key(stores["killed"]) in left
    assert os.listdir(held.path)  # the live run's snapshots are whole
    for tier in (opener, held, HostTier(stores["killed"])):
        tier.remove()


def test_gc_never_follows_a_link_nor_takes_a_folder_others_may_enter(tmp_path):
    tier = HostTier("file:///runs/a", root=str(tmp_path / "tier"))
    user = os.path.dirname(tier.path)
    tier.remove()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "r0-s0.data").write_bytes(b"someone's")
    os.symlink(elsewhere, os.path.join(user, "a" * 32))  # a run key's shape, planted as a link
    open_to_all = os.path.join(user, "b" * 32)
    os.mkdir(open_to_all, 0o700)
    os.chmod(open_to_all, 0o777)
    assert sweep(str(tmp_path / "tier"), lambda f: True) == []
    assert (elsewhere / "r0-s0.data").read_bytes() == b"someone's"
    assert os.path.islink(os.path.join(user, "a" * 32)) and os.path.isdir(open_to_all)
