"""Roll-back records are vouched for like manifests: a damaged or forged record sets nothing aside, never fails a
relaunch, and never brings back the lineage a real roll-back set aside (issue 20, item 5)."""

from __future__ import annotations

import json
import logging

import pytest

from checkpointing import CheckpointStore, Writer
from tests.hostile import DEEP, NAMES, checksum, progress, run_of, save

RECORD = "rollbacks/000000000002.json"


@pytest.fixture
def rolled_back(tmp_path) -> CheckpointStore:
    """Four units by writer generation 1, then generation 2 rolled the run back to the second."""
    store = run_of((str(tmp_path / "runs"), None), epochs=4)
    assert store.roll_back(NAMES[1], Writer.current(2)) == NAMES[2:]
    return store


def test_a_roll_back_record_carries_its_own_checksum_and_what_it_set_aside(rolled_back):
    record = json.loads(rolled_back.storage.get(RECORD))
    own = record.pop("checksum")
    assert own == checksum(record)
    assert record == {
        "format_version": 2,
        "generation": 2,
        "to": NAMES[1],
        "order": list(rolled_back.info(NAMES[1]).manifest.order),
        "set_aside": NAMES[2:],
        "num_set_aside": 2,
    }


def test_one_changed_digit_in_a_record_sets_nothing_aside_and_the_run_keeps_its_commits(backend, caplog):
    store = run_of(backend, epochs=4)
    store.roll_back(NAMES[1], Writer.current(2))
    again = save(store, 3, 2, name=store.name_for(progress(3), 2))
    store.storage.put(RECORD, store.storage.get(RECORD).replace(b'"generation": 2', b'"generation": 9'))
    with caplog.at_level(logging.WARNING):
        assert store.latest().name == again  # before checksums: set aside, and the run went back to NAMES[1]
    assert f"{store.uri}/{RECORD}: damaged (its content does not match its own checksum" in caplog.text
    assert '"generation": 9' not in caplog.text and caplog.text.count(RECORD) == 1  # reported once, never quoted


DAMAGE = {
    "changed digit in order": lambda data: data.replace(b'"order": [\n  1,\n  512', b'"order": [\n  1,\n  9512'),
    "order as a string": lambda data: json.dumps({**json.loads(data), "order": "1,512"}).encode(),
    "nested 100000 deep": lambda data: DEEP,
    "torn by a kill": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_record_does_not_bring_back_the_lineage_it_set_aside(rolled_back, damage, caplog):
    store = rolled_back
    store.storage.put(RECORD, DAMAGE[damage](store.storage.get(RECORD)))
    with caplog.at_level(logging.WARNING):
        assert store.latest().name == NAMES[1]  # latest, moved by the roll-back, still witnesses it
        assert store.set_aside() == NAMES[2:]
        assert [r["to"] for r in store.rollbacks()] == [NAMES[1]]  # a relaunch with the same resume_from: applied
        assert store.prune(keep=1) == []  # what the damaged record may have set aside is kept, and so is the rest
    assert f"{store.uri}/{RECORD}: damaged (" in caplog.text


def test_after_the_new_lineage_commits_a_damaged_record_still_leaves_it_first_and_retention_keeps_the_old(
    rolled_back, caplog
):
    store = rolled_back
    newer = [save(store, epoch, 2, name=store.name_for(progress(epoch), 2)) for epoch in (3, 4)]
    store.storage.put(RECORD, b"{}")
    with caplog.at_level(logging.WARNING):
        assert [i.name for i in store.candidates()][:2] == newer[::-1]  # generation 2 outranks generation 1
        assert store.prune(keep=1) == [newer[0]]  # never a checkpoint of generation 1 while the record is damaged
    assert [i.name for i in store.list()] == [*NAMES, newer[1]]


def test_hostile_files_in_rollbacks_never_fail_a_relaunch(rolled_back, caplog):
    store = rolled_back
    body = {"generation": 3, "to": NAMES[0], "order": "1,256", "format_version": 2}
    hostile = {
        "rollbacks/000000000003.json": json.dumps({**body, "checksum": checksum(body)}).encode(),  # a string order
        "rollbacks/000000000004.json": json.dumps({"generation": [4], "to": {}, "order": [[]]}).encode(),
        "rollbacks/000000000005.json": b"\xff\xfe not UTF-8",
        "rollbacks/000000000006.json": b" " * (2 << 20),
        "rollbacks/000000000007.json": json.dumps({"generation": 7, "to": "../../x", "order": [0, 0, 0]}).encode(),
        "rollbacks/8.json": b"{}",
        "rollbacks/\x1b]0;pwned\x07.json": b"{}",
        "rollbacks/nested/000000000009.json": b"{}",
    }
    for key, data in hostile.items():
        store.storage.put(key, data)
    with caplog.at_level(logging.WARNING):
        assert store.latest().name == NAMES[1]
        assert store.set_aside() == NAMES[2:] and [r["generation"] for r in store.rollbacks()] == [2]
        assert [i.name for i in store.best("loss")] == NAMES[1::-1]
        assert store.prune(keep=1) == []
        assert store.roll_back(NAMES[0], Writer.current(10)) == NAMES[1:]
    assert (
        "\x1b" not in caplog.text and "rollbacks/\\x1b]0;pwned\\x07.json: not a roll-back record's name" in caplog.text
    )


def test_a_record_from_before_checksums_counts_only_while_its_target_vouches_for_it(tmp_path, caplog):
    """What the previous version wrote: no format_version, no checksum, and latest moved to the target."""
    store = run_of((str(tmp_path / "runs"), None), epochs=4)
    target = store.info(NAMES[1])
    old = {"generation": 2, "to": NAMES[1], "order": list(target.manifest.order), "set_aside": NAMES[2:]}
    store.storage.put(RECORD, json.dumps(old, indent=1).encode())
    assert store.set_aside() == NAMES[2:]  # vouched for: the order is the target's own
    store.storage.put("latest", json.dumps({"name": NAMES[3], "generation": 1}).encode())  # no witness left
    assert store.set_aside() == NAMES[2:] and store.latest().name == NAMES[1]
    store.storage.put(RECORD, json.dumps({**old, "order": [1, 0, 0.0]}, indent=1).encode())  # one changed digit
    with caplog.at_level(logging.WARNING):
        assert store.set_aside() == []  # before: everything past sample 0 set aside, the run started over
        assert store.latest().name == NAMES[3]
    assert "a record from before checksums that its file name and its target's manifest do not vouch for" in caplog.text
