"""The folders a SIGKILLed process leaves in the temporary folder (a sweep's trial folder, a gang's, a node's: one
judgement, training/lifetimes.py ``remove_stale_folders``): the next one of its kind removes those whose process is
gone, and nothing else — not a live process's, not a link, not a file, not a name it did not give. The whole path (a
real sweep SIGKILLed, then relaunched) is tests/integration/test_sweeps.py's; this is the judgement of each entry, on
real files.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tasks.trial_runner import FOLDER_PREFIX
from training.lifetimes import remove_stale_folders


def dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_the_folders_of_gone_sweeps_are_removed(tmp_path):
    gone, live = dead_pid(), os.getpid()
    stale = tmp_path / f"{FOLDER_PREFIX}{gone}-ab_12cd9"
    (stale / "trial-x").mkdir(parents=True)
    (stale / "runner-1.json").write_text("{}")
    kept = [
        tmp_path / f"{FOLDER_PREFIX}{live}-ab_12cd9",  # a running sweep's (this process)
        tmp_path / f"{FOLDER_PREFIX}0-ab_12cd9",  # pid 0: no sweep's
        tmp_path / f"{FOLDER_PREFIX}{gone}-ab.12cd9",  # a name mkdtemp does not give
        tmp_path / f"other-{gone}-ab12cd9",
    ]
    for folder in kept:
        folder.mkdir()
    target = tmp_path / "elsewhere"
    (target / "keep").mkdir(parents=True)
    link = tmp_path / f"{FOLDER_PREFIX}{gone}-link1234"
    link.symlink_to(target, target_is_directory=True)
    plain = tmp_path / f"{FOLDER_PREFIX}{gone}-file1234"
    plain.write_text("not a folder")

    assert remove_stale_folders(FOLDER_PREFIX, str(tmp_path)) == [str(stale)]
    assert not stale.exists()
    assert all(folder.is_dir() for folder in kept)
    assert link.is_symlink() and (target / "keep").is_dir() and plain.is_file()
    assert remove_stale_folders(FOLDER_PREFIX, str(tmp_path / "missing")) == []  # no temporary folder: nothing to do
