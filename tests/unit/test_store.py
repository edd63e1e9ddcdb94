"""The checkpoint store on three backends: a local folder, memory://, and S3 over HTTP (moto server)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import uuid

import pytest
import torch

from checkpointing import CheckpointStore, UnsafeCheckpointError, Writer
from checkpointing.store import serialize


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "runs"), None
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex}/runs", None
    return request.getfixturevalue("s3")


def three_checkpoints(backend) -> CheckpointStore:
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    for i in range(3):
        store.save(f"c{i}", {"state.pt": {"state": {"model": {"w": torch.full((64,), float(i))}}},
                             "rng-rank0.pt": {"torch": torch.get_rng_state()}},
                   progress={"samples_seen": 10 * i, "epoch": i}, writer=Writer.current(1))
    return store


def model_of(loaded) -> torch.Tensor:
    return loaded.objects["state.pt"]["state"]["model"]["w"]


def test_saved_weights_round_trip_the_composer_way(backend):
    store = three_checkpoints(backend)
    assert [i.name for i in store.list()] == ["c0", "c1", "c2"]
    assert store.latest().name == "c2" and store.check("c2", deep=True) == []
    raw = store.storage.get("checkpoints/c2/state.pt")
    assert torch.equal(torch.load(__import__("io").BytesIO(raw), weights_only=True)["state"]["model"]["w"],
                       torch.full((64,), 2.0))
    assert json.loads(store.storage.get("latest")) == {"name": "c2", "generation": 1}


def test_a_checkpoint_without_manifest_does_not_count(backend):
    store = three_checkpoints(backend)
    store.storage.put("checkpoints/c3/state.pt", serialize({"x": {"w": torch.ones(1)}})["x"])  # files, no manifest
    assert "c3" not in [i.name for i in store.list()]
    assert store.latest().name == "c2"


CORRUPTIONS = {
    "truncated file": lambda st: st.put("checkpoints/c2/state.pt", st.get("checkpoints/c2/state.pt")[:-7]),
    "flipped byte": lambda st: st.put("checkpoints/c2/state.pt", _flip(st.get("checkpoints/c2/state.pt"))),
    "deleted file": lambda st: st.delete("checkpoints/c2/rng-rank0.pt"),
    "deleted manifest": lambda st: st.delete("checkpoints/c2/manifest.json"),
    "torn manifest": lambda st: st.put("checkpoints/c2/manifest.json", st.get("checkpoints/c2/manifest.json")[:40]),
}
WARNINGS = {"truncated file": "state.pt: size", "flipped byte": "does not match the manifest",
            "deleted file": "rng-rank0.pt: missing", "deleted manifest": "no readable manifest.json",
            "torn manifest": "unreadable manifest"}


def _flip(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_latest_falls_back_to_the_newest_good_checkpoint_with_a_warning(backend, corruption, caplog):
    store = three_checkpoints(backend)
    CORRUPTIONS[corruption](store.storage)
    with caplog.at_level(logging.WARNING):
        loaded = store.load_latest()
    assert loaded.info.name == "c1"
    assert torch.equal(model_of(loaded), torch.full((64,), 1.0))
    assert WARNINGS[corruption] in caplog.text


@pytest.mark.parametrize("pointer", [b'{"name": "does-not-exist", "generation": 1}', b"\x00garbage"])
def test_a_latest_pointer_to_nothing_is_replaced_by_listing(backend, pointer, caplog):
    store = three_checkpoints(backend)
    store.storage.put("latest", pointer)
    with caplog.at_level(logging.WARNING):
        assert store.load_latest().info.name == "c2"
    assert "does-not-exist" in caplog.text or "unreadable" in caplog.text


def test_retention_keeps_exactly_n_and_never_the_one_latest_names(backend):
    store = three_checkpoints(backend)
    store.storage.put("latest", json.dumps({"name": "c0", "generation": 1}).encode())  # latest points back
    deleted = store.prune(2)
    assert sorted(deleted) == ["c1"]
    assert [i.name for i in store.list()] == ["c0", "c2"]


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("form", ["torch.save file", "raw pickle"])
def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(backend, tmp_path, form):
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    marker = tmp_path / "pwned"
    payload = {"state": {"model": _Payload(str(marker))}}
    data = serialize({"f": payload})["f"] if form == "torch.save file" else pickle.dumps(payload)
    store.commit("evil", {"state.pt": data}, progress={"samples_seen": 1})  # a valid manifest vouches for it
    assert store.check("evil", deep=True) == []
    with pytest.raises(UnsafeCheckpointError, match="refusing it"):
        store.load("evil")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "..", ""])
def test_names_that_would_escape_the_save_folder_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="run_name="):
        CheckpointStore(str(tmp_path), name)
    assert list(tmp_path.iterdir()) == []
