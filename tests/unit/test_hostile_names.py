"""Names from a bucket: the checkpoint CLI prints them escaped, a run that is not there is an error, and folders
under ``checkpoints/`` that are not the store's are left alone by listing and retention (issue 20, item 7)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

from checkpointing import Writer
from tests.conftest import ROOT
from tests.hostile import NAMES, run_of

EVIL = "ep9\x1b]0;pwned\x07\x1b[2J\nep0-ba0-sa0  0  0  0  0.0  yes  *"  # sets the title, clears, forges a row


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "checkpointing", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ls_of_a_run_that_does_not_exist_is_one_line_and_exit_2(tmp_path):
    out = cli("ls", str(tmp_path / "runs" / "nothing"))
    assert out.returncode == 2 and out.stdout == ""
    assert (
        out.stderr == f"error: no run at {tmp_path / 'runs' / 'nothing'} (neither 'latest' nor 'checkpoints/' there)\n"
    )


def test_names_and_metrics_from_the_bucket_reach_the_terminal_escaped(tmp_path):
    store = run_of((str(tmp_path / "runs"), None), epochs=2)
    folder = tmp_path / "runs" / "r" / "checkpoints"
    shutil.copytree(folder / NAMES[0], folder / EVIL)  # a committed checkpoint under a hostile name
    store.save(
        "ep3-ba24-sa768",
        {"state.pt": {"w": 1}},
        progress={"samples_seen": 768},
        metadata={"metrics": {"\x1b]0;pwned\x07acc\nloss": 0.5}},
        writer=Writer.current(1),
    )
    listing, best = cli("ls", store.uri), cli("ls", store.uri, "--best", "accuracy")
    for out in (listing, best):
        assert "\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout + out.stderr
    assert listing.returncode == 0 and len(listing.stdout.splitlines()) == 4  # header + 3: no forged row
    assert "checkpoints/ep9\\x1b]0;pwned\\x07\\x1b[2J\\nep0-ba0-sa0" in listing.stderr  # reported, escaped
    assert best.returncode == 2
    assert best.stderr.splitlines()[-1].endswith("(they report: \\x1b]0;pwned\\x07acc\\nloss, loss)")


def test_retention_leaves_a_folder_that_is_not_a_checkpoint_name_alone_and_warns_once(backend, caplog):
    store = run_of(backend, epochs=3)
    copy = f"checkpoints/{NAMES[0]} copy"  # what a person's file manager makes
    original = {f: store.storage.get(f"checkpoints/{NAMES[0]}/{f}") for f in ("state.pt", "manifest.json")}
    for fname, data in original.items():
        store.storage.put(f"{copy}/{fname}", data)
    with caplog.at_level(logging.WARNING):
        assert [i.name for i in store.list()] == NAMES[:3]
        assert store.prune(keep=1) == [NAMES[1], NAMES[0]]
        assert store.prune(keep=1) == []
        assert store.latest().name == NAMES[2]
    assert {f: store.storage.get(f"{copy}/{f}") for f in original} == original  # untouched
    assert caplog.text.count("not a checkpoint name; this folder is not the store's and is left alone") == 1
