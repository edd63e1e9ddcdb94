"""Claims and local writes under attack: hostile claim files neither crash the fence nor reach a log raw, and a
local write killed midway never leaves a truncated file (issue 20, items 6 and 7d). Real files, a real process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

from checkpointing.io.localfs import LocalFiles
from checkpointing.io.untrusted import MAX_CLAIM_BYTES
from tests.conftest import ROOT
from tests.hostile import DEEP, run_of


def test_hostile_claims_neither_crash_the_fence_nor_reach_the_log_raw(tmp_path, caplog):
    store = run_of((str(tmp_path / "runs"), None))
    claims = tmp_path / "runs" / "r" / "claims"
    claims.mkdir()
    (claims / "²").write_text("{}")  # str.isdigit() says yes, int() says no
    (claims / ("9" * 40)).write_text("{}")  # not an int64
    (claims / "000000000003").write_bytes(DEEP)
    (claims / "000000000004").write_text("[]")
    (claims / "000000000005").write_text(json.dumps({"label": "\x1b]0;pwned\x07\nforged", "pid": "x", "host": 7}))
    (claims / "000000000006").write_bytes(b"{" * (MAX_CLAIM_BYTES + 10))
    os.makedirs(os.path.join(claims, *["7"] * 100))
    assert store.fence.newest() == 6
    assert [store.fence.read(g).label for g in (3, 4, 6)] == ["", "", ""]
    assert store.fence.read(5).label == "\\x1b]0;pwned\\x07\\nforged" and store.fence.read(5).pid == 0
    with caplog.at_level(logging.INFO):
        assert store.claim_generation("me") == 7
    assert "generation 6" in caplog.text and "\x1b" not in caplog.text


def test_a_local_write_killed_midway_leaves_the_old_latest_whole(tmp_path):
    """A real process writing ``latest`` is SIGKILLed while the bytes go out: the file holds the old content,
    never a truncated one (the new content only if the rename already happened)."""
    files, old, new = LocalFiles(str(tmp_path)), b'{"name": "old"}', b"n" * (512 << 20)
    files.write("latest", old)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from checkpointing.io.localfs import LocalFiles; LocalFiles({str(tmp_path)!r}).write('latest', b'n' * {len(new)})",
        ],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while writer.poll() is None and time.monotonic() < deadline:
        started = len(os.listdir(tmp_path)) > 1 or (tmp_path / "latest").stat().st_size != len(old)
        if started:
            os.kill(writer.pid, signal.SIGKILL)
            break
        time.sleep(0.001)
    writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    assert (tmp_path / "latest").read_bytes() in (old, new)
