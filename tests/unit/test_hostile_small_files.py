"""Oversized, deeply nested or ill-typed small files (``latest``, manifests, claims), too-deep folder trees and a
``latest`` emptied by a kill: each is a fallback or one warning, never an exception that fails every relaunch
(issue 20, items 6 and 7d). Real files in a real run folder, and the same through S3 (moto over HTTP)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from checkpointing import CheckpointError, Writer
from checkpointing.io.untrusted import MAX_MANIFEST_BYTES, MAX_POINTER_BYTES
from tests.conftest import ROOT
from tests.hostile import DEEP, NAMES, forge_manifest, run_of, weights_of

HUGE = 1 << 30


@pytest.mark.parametrize(
    "where, content, problem",
    [
        ("latest", DEEP, "larger than 4096 bytes"),
        ("latest", b"[" * 4000, "nested 4000 levels deep (at most 128)"),
        ("manifest", DEEP, "nested 100000 levels deep (at most 128)"),
    ],
    ids=["big latest", "deep latest", "deep manifest"],
)
def test_open_brackets_by_the_thousand_fall_back_to_the_previous_good_checkpoint(
    backend, where, content, problem, caplog
):
    store = run_of(backend)
    key = "latest" if where == "latest" else f"checkpoints/{NAMES[2]}/manifest.json"
    store.storage.put(key, content)
    with caplog.at_level(logging.WARNING):
        loaded = store.load_latest()
    expected = NAMES[2] if where == "latest" else NAMES[1]  # a bad latest: listing finds the newest anyway
    assert loaded.info.name == expected and weights_of(store, loaded) == float(NAMES.index(expected) + 1)
    assert problem in caplog.text
    assert "[[[[" not in caplog.text  # the content is never quoted back
    assert [i.name for i in store.list()] == NAMES[: 3 if where == "latest" else 2]


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda m: m["writer"].update(generation="7"), "writer.generation is not an integer"),
        (lambda m: m["metadata"].update(metrics=["loss", 0.1]), "metrics is a JSON array, not an object"),
        (lambda m: m["metadata"]["metrics"].update(loss="low"), "metadata.metrics['loss'] is not a number"),
        (lambda m: m["files"].update({"../../escape": m["files"]["state.pt"]}), "not one path segment"),
        (lambda m: m.update(created_at=[]), "created_at is not a number"),
        (lambda m: m["progress"].update(samples_seen=10**40), "progress['samples_seen'] is not an integer"),
    ],
    ids=["string generation", "metrics list", "string metric", "file path", "list time", "huge counter"],
)
def test_a_manifest_whose_fields_are_not_of_their_type_is_skipped_even_with_a_matching_checksum(
    tmp_path, change, problem, caplog
):
    store = run_of((str(tmp_path / "runs"), None))
    forge_manifest(store, NAMES[2], change)
    with caplog.at_level(logging.WARNING):
        assert store.latest().name == NAMES[1]
        assert [i.name for i in store.best("loss")] == NAMES[1::-1]
        assert store.prune(keep=1, score_attribute="loss", score_order="min") == [NAMES[0]]
    assert problem in caplog.text


def test_a_one_gib_latest_manifest_record_and_claim_are_never_read_whole(tmp_path):
    """Sparse 1 GiB files where each small file belongs: reading the run costs a few MB, not gigabytes."""
    run_of((str(tmp_path / "runs"), None))
    folder = tmp_path / "runs" / "r"
    for path in (
        "latest",
        f"checkpoints/{NAMES[2]}/manifest.json",
        "rollbacks/000000000005.json",
        "claims/000000000009",
    ):
        (folder / path).parent.mkdir(exist_ok=True)
        with open(folder / path, "wb") as f:
            f.truncate(HUGE)
    probe = textwrap.dedent(f"""
        import json, resource, torch  # what reading imports, imported before measuring
        from checkpointing import CheckpointStore
        store = CheckpointStore({str(tmp_path / "runs")!r}, "r")
        before = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
        found = (store.latest().name, store.rollbacks(), store.fence.read(9).generation, store.claim_generation())
        print(found, (int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found, grown_mb = out.stdout.rsplit(" ", 1)
    assert found == f"('{NAMES[1]}', [], 9, 10)"  # the huge manifest is skipped, the huge claim still counts
    assert int(grown_mb) < 200, f"reading the run grew the process by {grown_mb} MB"  # 1 GiB files: +1.85 GB before
    assert "larger than 16777216 bytes" in out.stderr and "larger than 1048576 bytes" in out.stderr


def test_on_s3_an_oversized_latest_and_manifest_are_fetched_no_further_than_their_caps(s3):
    folder, options = s3
    store = run_of((folder, options))
    store.storage.put("latest", b" " * (4 * MAX_POINTER_BYTES))
    store.storage.put(f"checkpoints/{NAMES[2]}/manifest.json", b" " * (MAX_MANIFEST_BYTES + (1 << 20)))
    fetched: list[int] = []
    cat_file = store.storage.fs.cat_file

    def measured(*args, **kwargs):
        data = cat_file(*args, **kwargs)
        fetched.append(len(data))
        return data

    store.storage.fs.cat_file = measured  # the real S3 call, measured
    assert store.latest().name == NAMES[1]
    assert max(fetched) == MAX_MANIFEST_BYTES + 1 and MAX_POINTER_BYTES + 1 in fetched


@pytest.fixture
def deep_tree_folder():
    """A save folder outside pytest's temporary folders (whose clean-up, shutil.rmtree, recurses once per
    level: a 1500-deep tree left there by a failed test would break the clean-up of every later session),
    removed afterwards by GNU rm, which does not recurse."""
    folder = tempfile.mkdtemp(prefix="hostile-deep-tree-")
    yield folder
    subprocess.run(["rm", "-rf", "--", folder], check=True, timeout=120)


def test_1500_nested_folders_in_a_checkpoint_fail_its_verification_and_the_reader_falls_back(deep_tree_folder, caplog):
    store = run_of((deep_tree_folder, None))
    deep = os.path.join(deep_tree_folder, "r", "checkpoints", NAMES[2])
    for _ in range(1500):  # os.makedirs itself recurses once per level
        deep = os.path.join(deep, "d")
        os.mkdir(deep)
    with caplog.at_level(logging.WARNING):
        assert store.latest().name == NAMES[1]
        problems = store.check(NAMES[2])
        store.delete(NAMES[2])  # removing the tree does not recurse either
    assert len(problems) == 1 and problems[0].startswith(f"{NAMES[2]}/d/d/d/") and "too deep" in problems[0]
    assert "folders nested deeper than 16 levels; not walked (damage)" in caplog.text
    assert not os.path.exists(os.path.join(deep_tree_folder, "r", "checkpoints", NAMES[2]))


def test_an_empty_latest_left_by_a_kill_is_rewritten_by_the_next_writer(backend, caplog):
    store = run_of(backend)
    vouched = json.loads(store.storage.get("latest"))
    store.storage.put("latest", b"")
    assert store.read_pointer() is None and store.latest().name == NAMES[2]  # readers list meanwhile
    assert store.storage.get("latest") == b""  # ... and never write
    with caplog.at_level(logging.WARNING):
        generation = store.claim_generation("relaunch")
    assert generation == 2 and json.loads(store.storage.get("latest")) == vouched
    assert f"rewriting it to name {NAMES[2]}" in caplog.text


def test_latest_naming_a_checkpoint_that_is_gone_is_rewritten_to_the_newest_good_one(tmp_path):
    store = run_of((str(tmp_path / "runs"), None))
    store.delete(NAMES[2])
    assert store._repair_pointer() == NAMES[1]
    assert store.read_pointer() == {
        "name": NAMES[1],
        "generation": 1,
        "manifest_sha256": store.info(NAMES[1]).manifest_sha256,
    }
    assert store._repair_pointer() is None  # nothing left to repair


def test_a_commit_whose_manifest_readers_would_refuse_fails_at_once_and_latest_stays(tmp_path):
    store = run_of((str(tmp_path / "runs"), None), epochs=1)
    deep: dict = {}
    for _ in range(200):  # recipe_args nested 200 deep: readers stop at 128 levels
        deep = {"a": deep}
    with pytest.raises(
        CheckpointError, match=r"ep2-ba16-sa512: readers would refuse its manifest .*nested 20\d levels"
    ):
        store.save(
            "ep2-ba16-sa512",
            {"state.pt": {"w": 1}},
            progress={"samples_seen": 512},
            metadata={"config": deep},
            writer=Writer.current(1),
        )
    assert store.read_pointer()["name"] == NAMES[0] and store.latest().name == NAMES[0]
    assert store.info("ep2-ba16-sa512") is None  # no manifest was written
