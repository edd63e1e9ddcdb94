"""Compressed zip entries: a small file that torch.load would unpack to far more than its size is refused
before torch.load sees it, through every door that torch.loads bytes from a store (issue 20, item 3)."""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch

from checkpointing import CorruptCheckpointError, UnsafeCheckpointError
from checkpointing.commit import sharded
from checkpointing.export import export_checkpoint
from checkpointing.peers.formats import read_weights
from tests.hostile import deflated, run_of, torch_bytes, vouch, weights_of

ZEROS = 16 << 20  # 16 Mi floats: 64 MiB unpacked, ~64 KiB deflated


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A real torch.save file of a large zero tensor, its entries deflated: what a bucket could hold."""
    return deflated(torch_bytes({"state": {"model": {"w": torch.zeros(ZEROS)}}}))


def test_the_bomb_is_real_torch_load_unpacks_it_to_a_thousand_times_its_size(bomb):
    assert len(bomb) < (256 << 10)
    unpacked = torch.load(io.BytesIO(bomb), weights_only=True)["state"]["model"]["w"]
    assert unpacked.numel() * unpacked.element_size() == 4 * ZEROS > 250 * len(bomb)


def test_a_state_file_with_deflated_entries_is_refused_before_it_is_loaded(backend, bomb):
    store = run_of(backend, epochs=2)
    vouch(store, "ep2-ba16-sa512", {"state.pt": bomb})  # a manifest vouches for it: the size check passes
    assert store.check("ep2-ba16-sa512", deep=True) == []
    with pytest.raises(UnsafeCheckpointError, match=r"ep2-ba16-sa512/state\.pt: refused: it holds compressed zip"):
        store.load("ep2-ba16-sa512")
    with pytest.raises(UnsafeCheckpointError):
        store.load_latest()


def test_zip_entries_declaring_more_than_the_file_holds_are_refused_though_none_is_compressed(tmp_path):
    """Stored entries that overlap (several pointing at the same bytes) unpack to more than the file holds."""
    store = run_of((str(tmp_path / "runs"), None), epochs=1)
    data = bytearray(store.storage.get("checkpoints/ep1-ba8-sa256/state.pt"))
    directory = data.rindex(b"PK\x01\x02")  # the last record: make its size claim the whole file, and more
    data[directory + 20 : directory + 28] = (len(data) * 2).to_bytes(4, "little") * 2
    vouch(store, "ep1-ba8-sa256", {"state.pt": bytes(data)})
    with pytest.raises(UnsafeCheckpointError, match=r"state\.pt: refused: its zip entries declare \d+ bytes, more"):
        store.load("ep1-ba8-sa256")


def test_a_vouched_state_file_torch_cannot_read_is_corrupt_and_the_reader_falls_back(tmp_path):
    store = run_of((str(tmp_path / "runs"), None), epochs=2)
    renamed = store.storage.get("checkpoints/ep2-ba16-sa512/state.pt").replace(b"/data.pkl", b"/data.pkX")
    vouch(store, "ep2-ba16-sa512", {"state.pt": renamed})  # a zip of the right shape without torch's data.pkl
    with pytest.raises(CorruptCheckpointError, match=r"ep2-ba16-sa512/state\.pt: not a readable torch\.save file"):
        store.load("ep2-ba16-sa512")
    loaded = store.load_latest()
    assert loaded.info.name == "ep1-ba8-sa256" and weights_of(store, loaded) == 1.0


def test_a_progress_copy_that_is_not_counts_is_corrupt_not_a_value_error(tmp_path):
    store = run_of((str(tmp_path / "runs"), None), epochs=2)
    state = {"state": {"model": {"w": torch.ones(4)}}, "progress": {"samples_seen": "lots\x1b[2J"}}
    vouch(store, "ep2-ba16-sa512", {"state.pt": torch_bytes(state)})
    with pytest.raises(
        CorruptCheckpointError, match=r"disagrees with the copy inside state\.pt \(samples_seen=lots"
    ) as info:
        store.load("ep2-ba16-sa512")
    assert "\x1b" not in str(info.value)  # shown escaped
    assert store.load_latest().info.name == "ep1-ba8-sa256"


def test_sharded_small_files_with_deflated_entries_are_refused(backend, bomb):
    store = run_of(backend, epochs=1)
    vouch(store, "ep1-ba8-sa256", {"extra-rank0.pt": bomb})
    with pytest.raises(UnsafeCheckpointError, match=r"extra-rank0\.pt: refused: it holds compressed zip entries"):
        sharded.load_files(store, store.info("ep1-ba8-sa256"), ["extra-rank0.pt"])


def test_a_dcp_tensor_item_with_deflated_entries_is_refused_before_dcp_loads_it(tmp_path):
    """DCP torch.loads each tensor item of a shard file itself: the item is bounded on its way there."""
    store = run_of((str(tmp_path / "runs"), None), epochs=0)
    info = sharded.save_state(store, "s1", {"model": {"w": torch.zeros(1 << 20)}}, progress={"samples_seen": 1})
    metadata = sharded.read_dcp_metadata(store, info)
    index, where = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == "model.w")
    item = store.storage.get(f"checkpoints/s1/{where.relative_path}")[where.offset : where.offset + where.length]
    shard = deflated(item)
    metadata.storage_data[index] = dataclasses.replace(where, relative_path="bomb.distcp", offset=0, length=len(shard))
    vouch(store, "s1", {"bomb.distcp": shard, ".metadata": pickle.dumps(metadata)})
    assert torch.load(io.BytesIO(shard), weights_only=True).numel() == 1 << 20  # what DCP would have done
    with pytest.raises(
        UnsafeCheckpointError, match=r"s1/bomb\.distcp \(item at byte 0\): refused: it holds compressed"
    ):
        sharded.load_state(store, store.info(info.name), {"model": {"w": torch.ones(1 << 20)}})


def test_a_weights_file_with_deflated_entries_is_refused_within_its_size_bound(tmp_path, bomb):
    path = tmp_path / "small.pt"
    path.write_bytes(bomb)
    with pytest.raises(UnsafeCheckpointError, match=r"load_path='.*small\.pt': refused: it holds compressed zip"):
        read_weights(str(path), max_bytes=len(bomb))  # passes the size bound by a factor of a thousand


def test_export_of_a_run_skips_a_vouched_state_file_without_a_model_and_exports_the_previous_one(tmp_path):
    store = run_of((str(tmp_path / "runs"), None), epochs=2)
    vouch(store, "ep2-ba16-sa512", {"state.pt": torch_bytes({"state": ["not", "a", "model"]})})
    export_checkpoint(store.uri, str(tmp_path / "model.pt"))
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["model"]["w"], torch.full((4,), 1.0))
