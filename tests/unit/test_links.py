"""A run folder may hold links planted by damage or by someone hostile: they are never followed.

Reading: a link (or a FIFO) where a file belongs is damage: its checkpoint is skipped with a warning, and
nothing outside the run is read (a FIFO would hang the reader). Writing: a link is removed, never
written through, so nothing outside the run changes.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from checkpointing import CheckpointStore, PermanentStorageError, Writer
from tests.unit.test_store import model_of

pytestmark = pytest.mark.timeout(60)  # a reader that followed a link to a FIFO would hang here


@pytest.fixture
def run(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    for i in range(3):
        store.save(
            f"c{i}",
            {"state.pt": {"state": {"model": {"w": torch.full((8,), float(i))}}}, "rng-rank0.pt": {"i": i}},
            progress={"samples_seen": 10 * i},
            writer=Writer.current(1),
        )
    return store, tmp_path / "runs" / "r", tmp_path / "outside"


def _replace_with_link(path, target) -> None:
    path.unlink()
    path.symlink_to(target)


def test_a_state_file_linked_to_a_fifo_outside_is_skipped_without_reading_it(run, caplog):
    store, folder, outside = run
    outside.mkdir()
    os.mkfifo(outside / "fifo")
    _replace_with_link(folder / "checkpoints/c2/state.pt", outside / "fifo")

    with caplog.at_level(logging.WARNING):
        loaded = store.load_latest()

    assert loaded.info.name == "c1" and torch.equal(model_of(loaded), torch.full((8,), 1.0))
    assert "c2/state.pt: a symbolic link or special file (never followed)" in caplog.text
    assert store.check("c2") == ["c2/state.pt: a symbolic link or special file (never followed)"]


def test_a_state_file_linked_to_a_file_outside_is_neither_read_nor_written_through(run):
    store, folder, outside = run
    outside.mkdir()
    secret = outside / "precious.pt"
    secret.write_bytes((folder / "checkpoints/c2/state.pt").read_bytes())  # same bytes: only the link is wrong
    _replace_with_link(folder / "checkpoints/c2/state.pt", secret)
    before = secret.read_bytes()

    assert store.latest().name == "c1"
    store.save("c2", {"state.pt": {"state": {"model": {"w": torch.zeros(8)}}}}, progress={"samples_seen": 20},
               writer=Writer.current(1))  # fmt: skip

    assert secret.read_bytes() == before  # never written through the link
    assert not (folder / "checkpoints/c2/state.pt").is_symlink()  # the link is gone, a real file is there
    assert torch.equal(model_of(store.load_latest()), torch.zeros(8))


def test_a_checkpoint_folder_linked_elsewhere_is_not_listed(run, caplog):
    store, folder, outside = run
    outside.mkdir()
    (folder / "checkpoints/c2").rename(outside / "c9")  # a complete, valid checkpoint ... outside the run
    (folder / "checkpoints/c9").symlink_to(outside / "c9")

    with caplog.at_level(logging.WARNING):
        names = [i.name for i in store.list()]

    assert names == ["c0", "c1"] and store.latest().name == "c1"
    assert "checkpoints/c9 is a symbolic link" in caplog.text


def test_a_latest_pointer_linked_to_a_file_outside_is_not_read(run):
    store, folder, outside = run
    outside.mkdir()
    (outside / "latest").write_text(json.dumps({"name": "c0", "generation": 99}))
    _replace_with_link(folder / "latest", outside / "latest")
    assert store.read_pointer() is None
    assert store.latest().name == "c2"


def test_a_run_folder_that_is_a_link_is_refused_for_writing_and_reads_as_empty(tmp_path):
    real = tmp_path / "elsewhere"
    CheckpointStore(str(real), "r").save("c0", {"state.pt": {"x": torch.ones(1)}}, progress={"samples_seen": 1})
    before = sorted(str(p.relative_to(real)) for p in real.rglob("*"))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").symlink_to(real / "r")

    store = CheckpointStore(str(tmp_path / "runs"), "r")
    assert store.list() == [] and store.latest() is None
    with pytest.raises(PermanentStorageError, match="is a symbolic link; links are never followed below the save"):
        store.claim_generation()
    assert (tmp_path / "runs" / "r").is_symlink()  # left as it was
    assert sorted(str(p.relative_to(real)) for p in real.rglob("*")) == before  # nothing written through it


def test_a_save_folder_that_is_a_link_is_the_users_choice_and_is_followed(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "disk")
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    store.save("c0", {"state.pt": {"x": torch.ones(1)}}, progress={"samples_seen": 1})
    assert (tmp_path / "disk" / "r" / "checkpoints" / "c0" / "manifest.json").is_file()
    assert store.latest().name == "c0"
