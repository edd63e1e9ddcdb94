"""The checkpoint store on three backends: a local folder, memory://, and S3 over HTTP (moto server)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle

import fsspec
import pytest
import torch

from checkpointing import CheckpointStore, CorruptCheckpointError, UnsafeCheckpointError, Writer
from checkpointing.store import serialize


def three_checkpoints(backend) -> CheckpointStore:
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    for i in range(3):
        store.save(
            f"c{i}",
            {
                "state.pt": {"state": {"model": {"w": torch.full((64,), float(i))}}},
                "rng-rank0.pt": {"torch": torch.get_rng_state()},
            },
            progress={"samples_seen": 10 * i, "epoch": i},
            writer=Writer.current(1),
        )
    return store


def model_of(loaded) -> torch.Tensor:
    return loaded.objects["state.pt"]["state"]["model"]["w"]


def test_saved_weights_round_trip_the_composer_way(backend):
    store = three_checkpoints(backend)
    assert [i.name for i in store.list()] == ["c0", "c1", "c2"]
    assert store.latest().name == "c2" and store.check("c2", deep=True) == []
    _folder, options = backend
    with fsspec.open(f"{store.uri}/checkpoints/c2/state.pt", "rb", **(options or {})) as f:  # the state file's URL
        assert torch.equal(torch.load(f, weights_only=True)["state"]["model"]["w"], torch.full((64,), 2.0))
    manifest_sha256 = hashlib.sha256(store.storage.get("checkpoints/c2/manifest.json")).hexdigest()
    assert json.loads(store.storage.get("latest")) == {
        "name": "c2",
        "generation": 1,
        "manifest_sha256": manifest_sha256,
    }


def test_a_checkpoint_without_manifest_does_not_count(backend):
    store = three_checkpoints(backend)
    store.storage.put("checkpoints/c3/state.pt", serialize({"x": {"w": torch.ones(1)}})["x"])  # files, no manifest
    assert "c3" not in [i.name for i in store.list()]
    assert store.latest().name == "c2"


class ProcessDied(BaseException):
    """Stands for the process dying mid-commit: nothing after it runs, no handler catches it."""


def _spy_puts(store: CheckpointStore, monkeypatch, dies_at: str | None = None) -> list[str]:
    """Records the keys the real ``Storage.put`` writes, in order; optionally dies before writing ``dies_at``."""
    written, real_put = [], store.storage.put

    def put(key: str, data: bytes) -> None:
        if dies_at and key.endswith(dies_at):
            raise ProcessDied(key)
        real_put(key, data)
        written.append(key)

    monkeypatch.setattr(store.storage, "put", put)
    return written


def _save_c3(store: CheckpointStore) -> None:
    store.save(
        "c3",
        {"state.pt": {"state": {"model": {"w": torch.full((64,), 3.0)}}}, "rng-rank0.pt": {"x": 1}},
        progress={"samples_seen": 30, "epoch": 3},
        writer=Writer.current(1),
    )


def test_a_commit_writes_the_files_then_the_manifest_then_latest(backend, monkeypatch):
    store = three_checkpoints(backend)
    written = _spy_puts(store, monkeypatch)
    _save_c3(store)
    assert sorted(written[:2]) == ["checkpoints/c3/rng-rank0.pt", "checkpoints/c3/state.pt"]
    assert written[2:] == ["checkpoints/c3/manifest.json", "latest"]


def test_a_commit_that_dies_before_its_manifest_leaves_the_previous_checkpoint_in_charge(backend, monkeypatch):
    store = three_checkpoints(backend)
    _spy_puts(store, monkeypatch, dies_at="manifest.json")
    with pytest.raises(ProcessDied):
        _save_c3(store)
    folder, options = backend
    fresh = CheckpointStore(folder, "r", storage_options=options)  # what the next process sees
    assert fresh.storage.exists("checkpoints/c3/state.pt")  # the files did land
    assert "c3" not in [i.name for i in fresh.list()]  # counted only with a manifest
    assert fresh.read_pointer()["name"] == "c2" and fresh.load_latest().info.name == "c2"


def test_a_commit_that_dies_between_its_manifest_and_latest_is_still_found(backend, monkeypatch):
    store = three_checkpoints(backend)
    _spy_puts(store, monkeypatch, dies_at="latest")
    with pytest.raises(ProcessDied):
        _save_c3(store)
    folder, options = backend
    fresh = CheckpointStore(folder, "r", storage_options=options)
    assert fresh.read_pointer()["name"] == "c2"  # latest never moved ...
    assert fresh.latest().name == "c3"  # ... but c3 verifies and is newer: nothing committed is redone
    assert torch.equal(model_of(fresh.load_latest()), torch.full((64,), 3.0))


CORRUPTIONS = {
    "truncated file": lambda st: st.put("checkpoints/c2/state.pt", st.get("checkpoints/c2/state.pt")[:-7]),
    "flipped byte": lambda st: st.put("checkpoints/c2/state.pt", _flip(st.get("checkpoints/c2/state.pt"))),
    "deleted file": lambda st: st.delete("checkpoints/c2/rng-rank0.pt"),
    "deleted manifest": lambda st: st.delete("checkpoints/c2/manifest.json"),
    "torn manifest": lambda st: st.put("checkpoints/c2/manifest.json", st.get("checkpoints/c2/manifest.json")[:40]),
}
WARNINGS = {  # each names the checkpoint, the file and what is wrong with it
    "truncated file": ["c2/state.pt: size"],
    "flipped byte": ["skipping checkpoint c2", "checkpoints/c2/state.pt", "does not match the manifest"],
    "deleted file": ["c2/rng-rank0.pt: missing"],
    "deleted manifest": ["latest names c2, which has no readable manifest.json"],
    "torn manifest": ["checkpoints/c2: unreadable manifest"],
}


def _flip(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_latest_falls_back_to_the_newest_good_checkpoint_with_a_warning(backend, corruption, caplog):
    store = three_checkpoints(backend)
    CORRUPTIONS[corruption](store.storage)
    with caplog.at_level(logging.WARNING):
        loaded = store.load_latest()
    assert loaded.info.name == "c1"
    assert torch.equal(model_of(loaded), torch.full((64,), 1.0))
    assert all(words in caplog.text for words in WARNINGS[corruption]), caplog.text


def test_a_flipped_byte_keeps_the_size_so_only_sha256_catches_it(backend):
    store = three_checkpoints(backend)
    CORRUPTIONS["flipped byte"](store.storage)
    assert store.check("c2") == []  # the sizes still match
    assert store.check("c2", deep=True) == ["c2/state.pt: sha256 mismatch"]
    with pytest.raises(CorruptCheckpointError, match=r"c2/state\.pt: .* does not match the manifest"):
        store.load("c2")


POINTERS = {  # what `latest` holds -> what the warning must name
    b'{"name": "does-not-exist", "generation": 1}': "latest names does-not-exist, which does not exist",
    b"\x00garbage": "latest is unreadable",
    b'["c0"]': "latest is unreadable",
    b'{"name": "../../other/checkpoints/o0", "generation": 9}': "latest name='../../other/checkpoints/o0'",
}


@pytest.mark.parametrize("pointer", list(POINTERS))
def test_a_latest_pointer_to_nothing_is_replaced_by_listing(backend, pointer, caplog):
    store = three_checkpoints(backend)
    if b"other" in pointer:  # a checkpoint of another run for the pointer to lead to
        other = CheckpointStore(backend[0], "other", storage_options=backend[1])
        other.save("o0", {"state.pt": {"state": {"model": {"w": torch.zeros(64)}}}}, progress={"samples_seen": 99})
    store.storage.put("latest", pointer)
    with caplog.at_level(logging.WARNING):
        loaded = store.load_latest()
    assert loaded.info.name == "c2" and torch.equal(model_of(loaded), torch.full((64,), 2.0))
    assert POINTERS[pointer] in caplog.text


@pytest.mark.parametrize("keep, kept", [(1, ["c0"]), (2, ["c0", "c2"]), (3, ["c0", "c1", "c2"])])
def test_retention_keeps_exactly_n_and_never_the_one_latest_names(backend, keep, kept):
    store = three_checkpoints(backend)
    store.storage.put("latest", json.dumps({"name": "c0", "generation": 1}).encode())  # latest points back
    deleted = store.prune(keep)
    assert [i.name for i in store.list()] == kept  # the oldest, c0, stays: latest names it
    assert sorted(deleted) == sorted({"c0", "c1", "c2"} - set(kept))
    assert store.storage.exists("checkpoints/c1/state.pt") == ("c1" in kept)  # deleted: files and all
    assert store.latest().name == kept[-1]  # the newest that verifies


class _RunsAShellCommand:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _OpensAFile(_RunsAShellCommand):
    def __reduce__(self):
        return (open, (self.marker, "w"))


PAYLOADS = {  # (how the file is written, the object whose unpickling would run code)
    "torch.save + os.system": (lambda obj: serialize({"f": obj})["f"], _RunsAShellCommand),
    "torch.save + builtins.open": (lambda obj: serialize({"f": obj})["f"], _OpensAFile),
    "raw pickle + os.system": (pickle.dumps, _RunsAShellCommand),
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the raw pickle's protocol, not a torch.save one
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(backend, tmp_path, payload):
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    write, evil = PAYLOADS[payload]
    marker = tmp_path / "pwned"
    data = write({"state": {"model": evil(str(marker))}})
    store.commit("evil", {"state.pt": data}, progress={"samples_seen": 1})  # a valid manifest vouches for it
    assert store.check("evil", deep=True) == []
    with pytest.raises(UnsafeCheckpointError, match=r"evil/state.pt holds objects that only an unsafe unpickler"):
        store.load("evil")
    with pytest.raises(UnsafeCheckpointError):
        store.load_latest()
    assert not marker.exists()
    # The payload is real: an unsafe load of the same bytes does run it.
    torch.load(io.BytesIO(data), weights_only=False) if payload.startswith("torch") else pickle.loads(data)
    assert marker.exists()


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "..", ""])
def test_names_that_would_escape_the_save_folder_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="run_name="):
        CheckpointStore(str(tmp_path), name)
    assert list(tmp_path.iterdir()) == []
