"""Issue 46, unit level: the checks a launch runs before any server (training/start/launch_checks.py), the
temporary server's "still starting" line, whose seconds move, and the loader workers' start line."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from flows import server
from training import lifetimes
from training.config import ConfigError


def test_still_starting_line_says_seconds_that_move(monkeypatch, capsys):
    """A wait that begins long after the server's start (an 82 s pre-flight) prints one line per NOTE_EVERY with the
    seconds elapsed at that moment, not a burst of lines repeating the same number."""
    monkeypatch.setattr(server, "NOTE_EVERY", 1.0)
    waiting = object.__new__(server.TemporaryServer)
    waiting.url = f"http://127.0.0.1:{server.free_port()}/api"  # nothing listens: it never answers
    waiting.ready = False
    waiting.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    waiting.started = time.monotonic() - 82
    with pytest.raises(RuntimeError, match="did not answer within"):
        waiting.wait_ready(patience=82 + 3.5)
    assert waiting.proc.poll() is not None  # stopped
    seconds = [
        int(s) for s in re.findall(r"still starting the temporary Prefect server \((\d+) s", capsys.readouterr().err)
    ]
    assert 2 <= len(seconds) <= 5, seconds
    assert seconds == sorted(set(seconds)), f"the same number printed again: {seconds}"
    assert seconds[0] == 82 and seconds[-1] >= 84, seconds


def test_launch_checks_refuse_a_changed_configuration_without_claiming(make_config, train_run):
    """The identity check reads the run folder's newest checkpoint and writes nothing: the claim is untouched."""
    from training.start.launch_checks import check_launch

    config = make_config(max_duration="1ep")
    train_run(config)
    run_dir = config.save_folder + "/r"
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"another configuration than this launch \(seed: 7 -> 8"):
        check_launch(make_config(max_duration="1ep", seed=8))
    with pytest.raises(ConfigError, match="autoresume=False but run_name='r' already has checkpoints"):
        check_launch(make_config(max_duration="1ep", autoresume=False))
    check_launch(make_config(max_duration="2ep"))  # a longer duration continues the same run
    check_launch(make_config(max_duration="1ep", autoresume=False, save_overwrite=True))  # starts over later
    assert snapshot(run_dir) == before


def test_launch_checks_refuse_a_recipe_not_allowed(make_config):
    from training.start.launch_checks import check_launch

    with pytest.raises(ConfigError, match="recipe='no_such_recipe' is not allowed"):
        check_launch(make_config(recipe="no_such_recipe"))


def test_a_new_runs_load_path_that_names_nothing_is_refused_a_resuming_run_ignores_it(make_config, train_run, tmp_path):
    """Before any server: a look at the path, no read. A run that resumes never reads load_path (its file may be gone)."""
    from training.start.launch_checks import check_launch

    gone = str(tmp_path / "gone.pt")
    with pytest.raises(ConfigError, match=re.escape(f"load_path={gone!r}: no such file or folder")):
        check_launch(make_config(max_duration="1ep", load_path=gone))
    train_run(make_config(max_duration="1ep"))
    check_launch(make_config(max_duration="2ep", load_path=gone))  # resumes: load_path is not looked at
    with pytest.raises(ConfigError, match="no such file or folder"):  # starts over: it would start from load_path
        check_launch(make_config(max_duration="1ep", autoresume=False, save_overwrite=True, load_path=gone))


def snapshot(folder: str) -> dict[str, tuple[int, int]]:
    import os

    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(root, name))
            found[os.path.join(root, name)] = (st.st_size, st.st_mtime_ns)
    return found


def test_loader_workers_start_is_one_line_with_its_seconds(make_config, train_run, caplog, monkeypatch):
    """num_workers > 0: the first unit pays the workers' start, and one line says how long it took; the workers
    live across units, so a second unit says nothing more. Without workers, nothing is said. Before the workers
    start, the named semaphores that killed process groups left in /dev/shm and no process maps go, once old
    (training/lifetimes.py; real ones: tests/unit/test_loader_workers_die.py)."""
    caplog.set_level(logging.INFO, logger="training")
    monkeypatch.setattr(lifetimes, "_swept", threading.Event())  # this process's sweep not done yet
    old, young = (os.path.join(lifetimes.SHM, f"{lifetimes.SEMAPHORE_PREFIX}test-{os.getpid()}-{age}") for age in "oy")
    for path in (old, young):
        with open(path, "wb") as f:
            f.write(b"\0" * 32)  # a sem_t's size: mapped by no process
    os.utime(old, (time.time() - 2 * lifetimes.ORPHAN_AGE_SECONDS,) * 2)
    try:
        train_run(make_config(max_duration="2ep", num_workers=1))
        assert not os.path.exists(old) and os.path.exists(young)
    finally:
        for path in (old, young):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loader workers started")]
    assert len(lines) == 1, lines
    seconds = float(re.fullmatch(r"loader workers started \(num_workers=1\) in ([\d.]+) s, .*", lines[0]).group(1))
    assert seconds > 0
    caplog.clear()
    train_run(make_config(run_name="no-workers", max_duration="1ep"))
    assert not [r for r in caplog.records if r.getMessage().startswith("loader workers started")]
