"""A sweep's ledger: events round-trip, a second writer is fenced, damage stops the reader with one clear error that
never quotes the file, a killed write leaves nothing; copy_checkpoint makes a checkpoint that verifies and loads; ls
on a sweep folder shows its trials."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
import torch

from checkpointing import (
    CheckpointStore,
    CorruptCheckpointError,
    Ledger,
    LedgerError,
    LedgerFencedError,
    Writer,
    copy_checkpoint,
    open_checkpoint_uri,
)
from checkpointing.errors import Permanent
from checkpointing.io.storage import Storage
from checkpointing.ledger import MAX_EVENT_BYTES, event_key
from tests.conftest import ROOT

SECRET = "CONTENT-THAT-MUST-NOT-BE-QUOTED"
NAME = "ep1-ba4-sa16"


@pytest.fixture(params=["local", "memory"])
def sweep(request, tmp_path) -> Storage:
    """A sweep folder on a local disk or memory://."""
    if request.param == "local":
        return Storage(str(tmp_path / "runs" / "sw"))
    return Storage(f"memory://{uuid.uuid4().hex}/runs/sw")


@pytest.fixture
def local(tmp_path) -> Storage:
    return Storage(str(tmp_path / "runs" / "sw"))


def three_events(storage: Storage) -> Ledger:
    ledger = Ledger(storage, writer="host:1")
    ledger.read()
    ledger.append("sweep_started", {"sweep_name": "sw", "spec": {"metric": "loss", "mode": "min"}})
    ledger.append("trial_created", {"trial": "t000", "index": 0, "params": {"recipe_args.lr": 0.01, "note": SECRET}})
    ledger.append("trial_completed", {"trial": "t000"})
    return ledger


def test_events_read_back_as_appended_numbered_from_zero(sweep):
    written = [three_events(sweep).append("trial_stopped", {"trial": "t000", "reason": "r"})]
    events = Ledger(sweep).read()
    assert [e.seq for e in events] == [0, 1, 2, 3]
    assert [e.kind for e in events] == ["sweep_started", "trial_created", "trial_completed", "trial_stopped"]
    assert events[1].body["params"] == {"recipe_args.lr": 0.01, "note": SECRET}
    assert events[3] == written[0] and events[0].writer == "host:1"
    assert sorted(sweep.sizes("sweep/events")) == [f"{i:08d}.json" for i in range(4)]


def test_a_reader_continues_the_numbering_and_a_second_writer_is_fenced(sweep):
    first = three_events(sweep)
    second = Ledger(sweep, writer="host:2")
    assert len(second.read()) == 3
    assert second.append("trial_completed", {"trial": "t001"}).seq == 3
    with pytest.raises(LedgerFencedError, match="another sweep process is writing this sweep") as fenced:
        first.append("trial_completed", {"trial": "t002"})
    assert isinstance(fenced.value, Permanent)
    assert [e.writer for e in Ledger(sweep).read()] == ["host:1"] * 3 + ["host:2"]


def test_append_refuses_a_kind_that_is_not_an_identifier(sweep):
    with pytest.raises(ValueError, match="event kind"):
        Ledger(sweep).append("Trial Created!", {})


def _rewrite(storage: Storage, seq: int, change) -> None:
    key = event_key("sweep", seq)
    raw = json.loads(storage.get(key))
    storage.put(key, change(raw))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda s: _rewrite(s, 1, lambda r: json.dumps({**r, "body": {**r["body"], "index": 7}}).encode()), "sha256"),
        (lambda s: s.put(event_key("sweep", 1), s.get(event_key("sweep", 1))[:40]), "not JSON"),
        (lambda s: _rewrite(s, 1, lambda r: json.dumps({**r, "seq": 0}).encode()), "its seq is not 1"),
        (lambda s: s.delete(event_key("sweep", 1)), "00000001.json: missing, while 00000002.json exists"),
        (lambda s: s.put(event_key("sweep", 1), b" " * (MAX_EVENT_BYTES + 1)), "more than an event may hold"),
        (lambda s: _rewrite(s, 1, lambda r: json.dumps({**r, "extra": SECRET}).encode()), "its fields are not"),
    ],
    ids=["tampered", "truncated", "wrong-seq", "gap", "oversized", "extra-field"],
)
def test_a_damaged_event_stops_the_reader_with_one_error_naming_the_file_never_its_content(sweep, damage, problem):
    three_events(sweep)
    damage(sweep)
    with pytest.raises(LedgerError, match=problem) as failed:
        Ledger(sweep).read()
    message = str(failed.value)
    assert "sweep/events/0000000" in message and "new sweep_name" in message
    assert SECRET not in message and "t000" not in message


def test_a_link_among_the_events_is_damage_never_followed(local, tmp_path):
    three_events(local)
    outside = tmp_path / "outside.json"
    outside.write_bytes(local.get(event_key("sweep", 1)))
    target = os.path.join(local.root, "sweep", "events", "00000001.json")
    os.unlink(target)
    os.symlink(outside, target)
    with pytest.raises(LedgerError, match=r"00000001\.json: a symbolic link or special file, never followed"):
        Ledger(local).read()


def test_files_that_are_not_events_are_ignored_with_one_warning(sweep, caplog):
    three_events(sweep)
    sweep.put("sweep/events/notes.txt", SECRET.encode())
    sweep.put("sweep/events/sub/00000003.json", b"{}")
    with caplog.at_level(logging.WARNING, "checkpointing.ledger"):
        assert len(Ledger(sweep).read()) == 3
    assert [r.getMessage().count("ignored") for r in caplog.records] == [1]
    assert "2 file(s) that are not events" in caplog.text


def test_a_write_killed_before_its_link_leaves_no_event_and_the_number_stays_free(local):
    three_events(local)
    events = os.path.join(local.root, "sweep", "events")
    with open(os.path.join(events, ".00000003.json.tmp-99999-deadbeef"), "wb") as half_written:
        half_written.write(b'{"format": 1, "se')  # what LocalFiles.create had written when the process died
    ledger = Ledger(local, writer="relaunch")
    assert len(ledger.read()) == 3
    assert ledger.append("trial_completed", {"trial": "t001"}).seq == 3
    assert len(Ledger(local).read()) == 4


def test_local_create_is_exclusive_and_leaves_no_temporary_file(local):
    assert local.create("claims/1", b"first") is True
    assert local.create("claims/1", b"second") is False
    assert local.get("claims/1") == b"first"
    assert os.listdir(os.path.join(local.root, "claims")) == ["1"]


# -- copy_checkpoint ---------------------------------------------------------------------------------------------
def donor(storage: Storage) -> CheckpointStore:
    store = CheckpointStore(storage.url, "t001")
    store.save(
        NAME,
        {"state.pt": {"state": {"model": {"w": torch.arange(64.0)}}}, "rng-rank0.pt": {"torch": torch.get_rng_state()}},
        progress={"epoch": 1, "step": 4, "samples_seen": 16},
        metadata={"metrics": {"loss": 0.5}},
        writer=Writer.current(1),
    )
    return store


def test_a_copied_checkpoint_verifies_and_loads_equal_as_a_load_path(sweep):
    source = donor(sweep)
    uri = copy_checkpoint(sweep, f"t001/checkpoints/{NAME}", f"sweep/exploits/t003-e1/checkpoints/{NAME}")
    assert uri == sweep.uri(f"sweep/exploits/t003-e1/checkpoints/{NAME}")
    copy = CheckpointStore(sweep.uri("sweep/exploits"), "t003-e1")
    assert copy.check(NAME, deep=True) == []
    loaded, original = open_checkpoint_uri(uri), source.load(NAME)
    assert torch.equal(
        loaded.objects["state.pt"]["state"]["model"]["w"], original.objects["state.pt"]["state"]["model"]["w"]
    )
    assert loaded.info.manifest == original.info.manifest


def test_copying_again_over_a_partial_copy_completes_it(sweep):
    donor(sweep)
    target = f"sweep/exploits/t003-e1/checkpoints/{NAME}"
    copy_checkpoint(sweep, f"t001/checkpoints/{NAME}", target)
    sweep.delete(f"{target}/rng-rank0.pt")
    sweep.put(f"{target}/state.pt", b"torn")
    copy_checkpoint(sweep, f"t001/checkpoints/{NAME}", target)
    assert CheckpointStore(sweep.uri("sweep/exploits"), "t003-e1").check(NAME, deep=True) == []


def test_a_source_that_does_not_verify_is_not_copied(sweep):
    donor(sweep)
    sweep.put(f"t001/checkpoints/{NAME}/state.pt", b"torn")
    with pytest.raises(CorruptCheckpointError, match="does not verify"):
        copy_checkpoint(sweep, f"t001/checkpoints/{NAME}", "sweep/exploits/t003-e1/checkpoints/x")
    assert not sweep.exists("sweep/exploits/t003-e1/checkpoints/x/manifest.json")


# -- ls on a sweep folder ----------------------------------------------------------------------------------------
def test_ls_on_a_sweep_folder_shows_each_trial_and_names_the_best(local):
    ledger = Ledger(local, writer="host:1")
    ledger.append("sweep_started", {"sweep_name": "sw", "spec": {"metric": "loss", "mode": "min"}})
    for index, losses in enumerate([[0.9, 0.7], [0.8, 0.3]]):
        trial = f"t{index:03d}"
        ledger.append("trial_created", {"trial": trial, "index": index, "params": {}})
        ledger.append("segment_started", {"trial": trial, "run_name": trial, "target_units": 2, "load_path": None})
        units = [
            {
                "unit": u + 1,
                "step": 4,
                "samples_seen": 16,
                "metrics": {"loss": v},
                "checkpoint": f"{local.url}/{trial}/checkpoints/ep{u}-ba4-sa16",
            }
            for u, v in enumerate(losses)
        ]
        ledger.append(
            "segment_finished", {"trial": trial, "run_name": trial, "target_units": 2, "status": "ok", "units": units}
        )
        ledger.append("trial_completed", {"trial": trial})
    ledger.append("trial_created", {"trial": "evil\x1b]0;owned\x07", "index": 2, "params": {}})
    out = subprocess.run(
        [sys.executable, "-m", "checkpointing", "ls", local.url], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["trial", "state", "runs", "units", "last", "loss", "best", "loss", "best", "checkpoint"]
    assert lines[1].split()[:6] == ["t000", "completed", "t000", "2", "0.7", "0.7"]
    assert lines[2].split()[:6] == ["t001", "completed", "t001", "2", "0.3", "0.3"]
    assert lines[-1] == f"best trial so far: t001 (loss 0.3) at {local.url}/t001/checkpoints/ep1-ba4-sa16"
    assert len(lines) == 4 and "\x1b" not in out.stdout
