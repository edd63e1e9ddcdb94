"""The store's retry policy follows its time budget (checkpointing/io/storage.py ``RetrySettings``), and what fails for
good is said in the product's words: a missing bucket names the bucket, a full disk and a refused folder say so at
the path, whatever wrapped the OSError (torch.save's ``RuntimeError: [enforce fail at inline_container...``)."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from checkpointing import RetrySettings, StorageError
from checkpointing.errors import AccessDeniedError, Permanent, PermanentStorageError
from checkpointing.io.storage import Storage, _storage_error
from tests.conftest import ROOT


def flaky_for(seconds: float) -> tuple[list[float], object]:
    """A call that times out (a transient fault) until ``seconds`` have passed since its first try."""
    calls: list[float] = []

    def call() -> bytes:
        calls.append(time.monotonic())
        if calls[-1] - calls[0] < seconds:
            raise TimeoutError("connect timed out")
        return b"through"

    return calls, call


def test_a_fault_longer_than_the_attempts_is_absorbed_while_the_budget_lasts(tmp_path, caplog):
    """Before: stop after ``attempts`` (2 here) whatever the budget; the outage outlived them."""
    storage = Storage(str(tmp_path), retry=RetrySettings(attempts=2, max_seconds=10, initial_wait=0.05, max_wait=0.2))
    calls, call = flaky_for(1.5)
    with caplog.at_level(logging.WARNING, logger="checkpointing.io.storage"):
        assert storage.retried("get x", call) == b"through"
    assert len(calls) > 2 and calls[-1] - calls[0] >= 1.5
    waits = [float(r.getMessage().rsplit("retrying in ", 1)[1].rstrip("s")) for r in caplog.records]
    assert waits and max(waits) <= 0.2  # the back-off is capped: the call asks again soon after the fault ends


def test_a_call_gives_up_when_its_budget_is_spent_and_starts_no_attempt_after_it(tmp_path, caplog):
    storage = Storage(str(tmp_path), retry=RetrySettings(attempts=2, max_seconds=1.0, initial_wait=0.3, max_wait=4))
    calls, call = flaky_for(3600)
    refused = pytest.raises(StorageError, match=r"get x at .* failed \(transient, retries exhausted\): TimeoutError")
    with caplog.at_level(logging.WARNING, logger="checkpointing.io.storage"), refused:
        storage.retried("get x", call)
    assert calls[-1] - calls[0] >= 1.0  # it asked until the budget was spent
    # ... and no longer: the wait before the last attempt was cut to what the budget had left. Read from the waits the
    # policy chose (each retry's log record), not from the clock: a sleep lasts at least what it was asked, so the
    # chosen waits of a policy that cuts add up to at most the budget whatever the machine's load; uncut, the last
    # back-off (up to 4 s here) would overshoot it.
    waits = [record.args[-1] for record in caplog.records if record.args]
    assert len(waits) == len(calls) - 1 and sum(waits) <= 1.0, waits


def test_the_attempts_are_a_floor_when_the_budget_is_spent_at_once(tmp_path):
    storage = Storage(str(tmp_path), retry=RetrySettings(attempts=3, max_seconds=0, initial_wait=0.01))
    calls, call = flaky_for(3600)
    with pytest.raises(StorageError, match="retries exhausted"):
        storage.retried("get x", call)
    assert len(calls) == 3


def test_a_full_disk_under_torch_save_is_said_in_those_words_at_the_path():
    """/dev/full answers every write with ENOSPC: torch.save turns it into its own RuntimeError (the OSError on its
    chain); the store's error says "no space left on device" at the checkpoint's path, in one line."""
    disk = open("/dev/full", "wb")  # noqa: SIM115 (closed below, its flush failing too); buffered: the first records fit in the buffer, the tensor's write fails
    try:
        with pytest.raises(RuntimeError) as raised:
            torch.save({"w": torch.zeros(1 << 16)}, disk)
    finally:
        with contextlib.suppress(OSError):  # what is left in the buffer cannot be flushed either
            disk.close()
    assert "enforce fail" in str(raised.value)  # what a user saw before
    error = _storage_error("upload of checkpoint ep2", "/data/runs/r", raised.value, True, "/data/runs/r/ep2")
    assert isinstance(error, PermanentStorageError) and isinstance(error, Permanent)  # never retried
    assert str(error).startswith("upload of checkpoint ep2 failed: no space left on device at /data/runs/r/ep2; free")
    assert "\n" not in str(error) and "enforce" not in str(error)


def test_a_folder_this_user_may_not_write_is_permission_denied_at_its_path(tmp_path):
    """A real EACCES: a child process drops to user nobody (root would pass any permission check) after its
    imports, then writes under a folder only root may enter."""
    folder = tmp_path / "private" / "runs"
    folder.mkdir(parents=True)
    (tmp_path / "private").chmod(0o700)
    script = textwrap.dedent(f"""
        import os, sys
        from checkpointing.io.storage import Storage
        from checkpointing.errors import AccessDeniedError
        storage = Storage({str(folder)!r})
        os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
        try:
            storage.put("state.pt", b"x")
        except AccessDeniedError as exc:
            print(exc)
            sys.exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"put state.pt failed: permission denied at {folder} (EACCES on "), line
    assert AccessDeniedError.__mro__[1] is PermanentStorageError


@pytest.mark.slow
def test_ls_of_a_missing_bucket_names_the_bucket(moto_server):
    """Before: "error: no run at s3://<bucket>/runs/a" (an empty run, as if the bucket were there)."""
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{moto_server}"}}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "checkpointing",
            "ls",
            f"s3://{bucket}/runs/a",
            "--storage-options",
            json.dumps(options),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line == f"error: no such bucket '{bucket}' (in s3://{bucket}/runs/a): create it, or fix the bucket's name"
