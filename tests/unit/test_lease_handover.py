"""A lease whose holder exited on this machine is taken over at once (checkpointing/fencing.py): a SIGKILLed run
relaunched where it ran used to wait LEASE_STALE (15 s) for its own dead lease. Real holder processes, killed with
real signals; everything that cannot prove the holder gone here keeps the wait."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from checkpointing import CheckpointStore
from checkpointing.fencing import LEASES, Fence, exited_here, process_identity

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="Linux: /proc tells a process apart")

HOLDER = textwrap.dedent(
    """
    import sys, time
    from checkpointing import CheckpointStore
    from checkpointing.fencing import Lease
    store = CheckpointStore(sys.argv[1], "r")
    generation = store.fence.claim(floor=0, label="holder")
    Lease(store.fence, generation, on_stop=lambda request: None).start()
    print(generation, flush=True)
    time.sleep(600)
    """
)


def _holder(folder) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _stop_asked(fence: Fence, generation: int) -> bool:
    return fence.storage.exists(f"{LEASES}/{generation:012d}.stop")


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_sigkilled_holder_on_this_machine_is_taken_over_without_waiting_for_its_lease(tmp_path, caplog, reaped):
    proc, generation = _holder(tmp_path)
    fence = CheckpointStore(str(tmp_path), "r").fence
    try:
        assert not exited_here(fence.read_lease(generation) or {})  # alive: it would be asked to hand over
        proc.send_signal(signal.SIGKILL)
        if reaped:
            proc.wait(timeout=30)
        else:  # killed, not yet reaped by its parent (a worker that has not polled yet): a zombie is gone too
            deadline = time.monotonic() + 30
            while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
                assert time.monotonic() < deadline, "the killed holder never became a zombie"
                time.sleep(0.01)
        with caplog.at_level(logging.INFO, logger="checkpointing.fencing"):
            assert fence.claim(floor=0, handover_seconds=60) == generation + 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not _stop_asked(fence, generation)  # no handover asked of a process known gone, and none waited for
    assert any("which has exited: taken over at once" in r.getMessage() for r in caplog.records), caplog.text


def test_a_live_holder_is_asked_to_hand_over(tmp_path):
    proc, generation = _holder(tmp_path)
    fence = CheckpointStore(str(tmp_path), "r").fence
    try:
        fence.take_over(generation, "newer", "", timeout=0.1)  # it never answers: fenced out after the timeout
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert _stop_asked(fence, generation)


def test_only_a_lease_that_proves_its_holder_gone_here_skips_the_wait():
    here = process_identity(os.getpid())
    assert here is not None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    gone = {**here, "pid": dead.pid}
    assert exited_here({"process": gone})
    parent = process_identity(os.getppid())
    assert parent is not None and not exited_here({"process": parent})  # alive
    assert exited_here({"process": {**parent, "start": parent["start"] + 1}})  # its pid, reused by another process
    assert not exited_here({"process": here})  # this very process
    for key, other in [("host", "elsewhere"), ("boot", "another-boot"), ("pidns", here["pidns"] + 1),
                       ("uid", here["uid"] + 1)]:  # fmt: skip
        assert not exited_here({"process": {**gone, key: other}}), key  # its pid says nothing here
    for bad in [True, "1", -1, 0, 2**70, None]:  # what a forged lease may hold: never a reason to skip the wait
        assert not exited_here({"process": {**gone, "pid": bad}}), bad
        assert not exited_here({"process": {**gone, "start": bad}}), bad
    assert not exited_here({"process": "a string"}) and not exited_here({})
