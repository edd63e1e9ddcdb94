"""Streamed saves and commits of files written elsewhere, on a local folder, memory:// and S3 over HTTP (moto)."""

from __future__ import annotations

import pickle

import pytest
import torch

from checkpointing import CheckpointError, CheckpointStore, Writer
from checkpointing.commit.streaming import remote_block_size, save_streaming, write_object


def test_commit_files_refuses_a_file_that_did_not_land_as_reported(backend):
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    entry = write_object(store.storage, "checkpoints/c/a.pt", {"x": torch.ones(3)})
    store.commit_files("c", {"a.pt": entry}, progress={})
    write_object(store.storage, "checkpoints/d/a.pt", {"x": torch.ones(3)})
    longer = type(entry)(entry.size + 1, entry.sha256)
    with pytest.raises(
        CheckpointError, match=rf"d/a.pt: size {entry.size} != {entry.size + 1} in manifest; d/b.pt: missing"
    ):
        store.commit_files("d", {"a.pt": longer, "b.pt": entry}, progress={})
    assert [i.name for i in store.list()] == ["c"] and store.read_pointer()["name"] == "c"


def test_a_streamed_save_is_the_same_checkpoint_that_save_writes(backend):
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    big = torch.randn(2_600_000)  # 10.4 MB: more than one 8 MiB part on an object store
    objects = {"state.pt": {"state": {"model": {"w": big}}}, "rng-rank0.pt": {"torch": torch.ones(4)}}
    store.save("a", objects, progress={"samples_seen": 1}, writer=Writer.current(1))
    info = save_streaming(
        store, "b", objects, progress={"samples_seen": 2}, metadata={"k": 1}, writer=Writer.current(1)
    )
    assert store.latest().name == "b" and store.check("b", deep=True) == []
    assert info.manifest.files == store.info("a").manifest.files  # same bytes, same sizes and hashes
    loaded = store.load("b").objects
    assert torch.equal(loaded["state.pt"]["state"]["model"]["w"], objects["state.pt"]["state"]["model"]["w"])


def test_a_streamed_save_that_fails_midway_commits_nothing(backend):
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    save_streaming(store, "a", {"state.pt": {"w": torch.ones(2)}}, progress={"samples_seen": 1})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_streaming(store, "b", {"state.pt": {"w": torch.ones(2)}, "x.pt": lambda: 0}, progress={"samples_seen": 2})
    assert [i.name for i in store.list()] == ["a"] and store.read_pointer()["name"] == "a"
    assert not store.storage.exists("checkpoints/b/x.pt")


def test_no_file_is_written_through_a_planted_symlink(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "runs/r/checkpoints/c").mkdir(parents=True)
    (tmp_path / "runs/r/checkpoints/c/a.pt").symlink_to(victim)
    write_object(store.storage, "checkpoints/c/a.pt", {"x": 1})  # the link is removed, a real file written
    assert victim.read_text() == "precious" and not (tmp_path / "runs/r/checkpoints/c/a.pt").is_symlink()
    (tmp_path / "runs/r/checkpoints/c/a.pt").unlink()
    (tmp_path / "runs/r/checkpoints/c/a.pt").symlink_to(victim)
    save_streaming(store, "c", {"a.pt": {"x": 1}}, progress={})
    assert victim.read_text() == "precious" and not (tmp_path / "runs/r/checkpoints/c/a.pt").is_symlink()


def test_object_store_parts_stay_small_unless_a_file_needs_more_than_s3s_10000_parts():
    mib = 1024 * 1024
    assert remote_block_size(200 * 10**6) == 8 * mib  # ~50 MB in flight, not fsspec's 50 MiB blocks x copies
    huge = 200 * 10**9  # one rank's shard of a very large model
    assert huge / remote_block_size(huge) <= 9000 and remote_block_size(huge) % mib == 0
    assert remote_block_size(None) == 64 * mib  # size unknown: room for 600 GB
