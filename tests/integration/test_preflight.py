"""Issue 46: a launch the configuration and the run folder refuse is refused before any Prefect server starts.

``python -m flows.train`` relaunched with another seed on an existing run used to start the temporary server, import
Prefect and the recipe, and only then refuse (103.6 s at load ~15). The evidence here is the process's own: an
audit hook (a ``sitecustomize`` on PYTHONPATH) writes every process the command spawns, so a test passes only when
none was; no server answers at the PREFECT_PORT it would look at, and no API or profile is configured, so without
the early check the command would start its temporary server (``python -m flows.server``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.server import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SPAWN_HOOK = """
import os, sys
_log = os.environ.get("SPAWN_LOG")
if _log:
    def _spawned(event, args):
        if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system", "os.fork", "os.forkpty"):
            with open(_log, "a") as f:
                f.write(f"{event} {args!r}\\n")
    sys.addaudithook(_spawned)
"""


def command_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """No Prefect API anywhere: not in the environment, not in a profile, no server at PREFECT_PORT."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SPAWN_HOOK)
    log = tmp_path / "spawned.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "PREFECT_"))}
    env.update(
        PYTHONPATH=f"{hook}{os.pathsep}{ROOT}",
        SPAWN_LOG=str(log),
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_PROFILES_PATH=str(tmp_path / "no-profiles.toml"),
        PREFECT_PORT=str(free_port()),
    )
    return env, log


def spawned(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_spawn_hook_sees_a_child(tmp_path):
    """The evidence works: a process that spawns one is seen doing so."""
    env, log = command_env(tmp_path)
    subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'])"],
        env=env,
        check=True,
        cwd=tmp_path,
    )
    assert len([line for line in spawned(log) if line.startswith("subprocess.Popen")]) == 1


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--seed", "8"], "was trained with another configuration than this launch (seed: 7 -> 8"),
        (["--autoresume", "false"], "autoresume=False but run_name='r' already has checkpoints"),
    ],
    ids=["changed-seed", "autoresume-false"],
)
def test_a_refused_relaunch_starts_no_server(tmp_path, make_config, train_run, flags, refusal):
    config = make_config(max_duration="1ep")
    train_run(config)
    env, log = command_env(tmp_path)
    argv = [
        "--run_name", "r", "--save_folder", config.save_folder, "--recipe", config.recipe,
        "--recipe_args", '{"num_samples": 256}', "--max_duration", "1ep", "--save_interval", "1ep",
        "--global_batch_size", "32", "--seed", "7",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "flows.train", *argv, *flags], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert spawned(log) == [], "the refused launch spawned a process (a temporary Prefect server)"
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and refusal in lines[0], done.stderr
    assert "temporary Prefect server" not in done.stderr
    assert not (tmp_path / "prefect").exists()  # no server created its database


def test_a_sweep_of_a_recipe_not_allowed_starts_no_server(tmp_path):
    env, log = command_env(tmp_path)
    argv = ["--recipe", "no_such_recipe", "--max_duration", "1ep", "--save_folder", str(tmp_path / "runs"),
            "--sweep_name", "lr", "--space", '{"recipe_args.lr": {"grid": [0.003, 0.03]}}',
            "--metric", "eval_accuracy", "--mode", "max"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "flows.sweep", *argv], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert spawned(log) == [], "the refused sweep spawned a process (a temporary Prefect server)"
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith("error: recipe='no_such_recipe' is not allowed"), done.stderr
    assert not (tmp_path / "runs").exists()
