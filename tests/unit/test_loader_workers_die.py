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
from tests.deadlines import deadline
from tests.procs import alive, group_gone
from training import lifetimes

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


MAKER = (
    "import multiprocessing, sys\n"
    "lock = multiprocessing.get_context('forkserver').Lock()\n"
    "print('made', flush=True)\n"
    "sys.stdin.read()\n"
)


def _semaphores() -> set[str]:
    return {name for name in os.listdir(lifetimes.SHM) if name.startswith(lifetimes.SEMAPHORE_PREFIX)}


def _semaphores_of(pid: int, group: bool = False) -> set[str]:
    """The semaphores in /dev/shm that ``pid`` (with ``group``: any process of the group it leads) maps, by inode: what
    a test's own processes made, never another xdist worker's (which come and go in the same folder meanwhile)."""
    device = os.stat(lifetimes.SHM).st_dev
    device_field = f"{os.major(device):02x}:{os.minor(device):02x}"
    pids = [p for p in os.listdir("/proc") if p.isdigit() and (p == str(pid) or (group and _group_of(p) == pid))]
    inodes = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/maps", encoding="utf-8", errors="replace") as maps:
                inodes |= {
                    int(f[4]) for f in (line.split(maxsplit=5) for line in maps) if len(f) > 4 and f[3] == device_field
                }
        except (OSError, ValueError):
            continue
    found = set()
    for name in _semaphores():
        try:
            if os.stat(os.path.join(lifetimes.SHM, name)).st_ino in inodes:
                found.add(name)
        except OSError:
            continue
    return found


def _group_of(pid: str) -> int | None:
    try:
        return os.getpgid(int(pid))
    except (OSError, ValueError):
        return None


def _trainer_in_its_own_group(tmp_path, name: str) -> subprocess.Popen:
    """A trainer-like process (the product's loader set-up) leading a process group of its own, its workers up."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen(
        [sys.executable, str(script), "watched"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None and len(proc.stdout.readline().split()) == 2, name
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    end = deadline(60)
    while not group_gone(proc.pid):  # the forkserver and the workers follow the trainer (die_with)
        assert time.monotonic() < end, "the killed group's processes are still there"
        time.sleep(0.05)


def test_the_semaphores_a_killed_group_leaves_are_removed_and_a_live_loaders_kept(tmp_path):
    """A SIGKILL of a trainer's whole group (its resource tracker too) leaves its loader's named semaphores in
    /dev/shm; the sweep a loader runs before it starts its workers removes them once they are old enough, and never a
    live loader's (mapped by it and its workers), a lock that only its maker maps (glibc made it under another name,
    so the maker's mapping does not read the name), or another user's."""
    live = _trainer_in_its_own_group(tmp_path, "live")
    maker = subprocess.Popen(  # a lock no child opened: only its maker maps it, under the name it was made with
        [sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert maker.stdout is not None and maker.stdout.readline().strip() == "made"
        made = _semaphores_of(maker.pid)
        live_names = _semaphores_of(live.pid, group=True) | made  # by mapping: other workers' tests share /dev/shm
        victim = _trainer_in_its_own_group(tmp_path, "victim")
        left = _semaphores_of(victim.pid, group=True) - live_names
        _kill_group(victim)
        assert made and not made & left
        assert live_names and left and left <= _semaphores()  # the leak is real: the names outlive their group

        assert not set(lifetimes.remove_orphaned_semaphores(older_than=3600)) & left  # too young: kept
        assert left <= _semaphores()
        other_user = None
        if os.getuid() == 0:  # root may make a file of another user's: an orphan by every other measure
            other_user = f"{lifetimes.SEMAPHORE_PREFIX}another-user-{os.getpid()}"
            path = os.path.join(lifetimes.SHM, other_user)
            with open(path, "wb") as f:
                f.write(b"\0" * 32)
            os.chown(path, 65534, 65534)
        try:
            removed = set(lifetimes.remove_orphaned_semaphores(older_than=0))
            assert left <= removed and not left & _semaphores()  # the killed group's: gone
            assert not live_names & removed and live_names <= _semaphores()  # the live loader's: kept
            assert other_user is None or (other_user not in removed and other_user in _semaphores())
        finally:
            if other_user is not None:
                os.unlink(os.path.join(lifetimes.SHM, other_user))
    finally:
        maker.kill()
        maker.wait(timeout=30)
        _kill_group(live)
        lifetimes.remove_orphaned_semaphores(older_than=0)
