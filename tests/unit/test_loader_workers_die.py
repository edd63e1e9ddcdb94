"""DataLoader workers of a SIGKILLed trainer do not outlive it (training/lifetimes.py, ``die_with``).

The product's loaders start their workers through multiprocessing's forkserver; a worker is the forkserver's child,
and the forkserver lives as long as any worker does, so PyTorch's own parent check never fires: every SIGKILLed
trainer with workers left its forkserver and workers behind for ever (found after the format kill tests). A real
trainer-like process here: a forkserver DataLoader built with the product's ``worker_init_fn``, really SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import ROOT
from tests.procs import alive

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds: Linux 5.3 and later")

TRAINER = textwrap.dedent(
    """
    import functools, os, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    from training.lifetimes import die_with

    class Pids(Dataset):
        def __len__(self):
            return 1000
        def __getitem__(self, i):
            return torch.tensor(os.getpid())

    if __name__ == "__main__":
        watched = sys.argv[1] == "watched"
        loader = DataLoader(Pids(), batch_size=1, num_workers=2, multiprocessing_context="forkserver",
                            persistent_workers=True,
                            worker_init_fn=functools.partial(die_with, os.getpid()) if watched else None)
        pids, batches = set(), iter(loader)
        while len(pids) < 2:
            pids.add(int(next(batches)))
        print(*sorted(pids), flush=True)
        time.sleep(600)
    """
)


def _workers_after_a_sigkill(tmp_path, mode: str, wait: float) -> list[int]:
    """The worker pids still alive ``wait`` s after the trainer was SIGKILLed (sooner, once they have all gone)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    workers = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(workers) == 2 and all(alive(pid) for pid in workers)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + wait
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in workers if alive(pid)]


def test_the_workers_of_a_sigkilled_trainer_exit_with_it(tmp_path):
    assert _workers_after_a_sigkill(tmp_path, "watched", wait=30) == []


def test_without_it_they_outlive_the_trainer(tmp_path):
    """What the product's loaders did before: the premise of the test above, checked (and cleaned up)."""
    left = _workers_after_a_sigkill(tmp_path, "unwatched", wait=3)
    try:
        assert len(left) == 2
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # the forkserver then sees its alive pipe close and exits
