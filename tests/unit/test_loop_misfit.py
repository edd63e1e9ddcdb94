"""A loop of the user's own that loads a state that does not fit its model fails the same way on every attempt and on
every rank: one ConfigError naming the recipe, never retried (it was retried twice, 92 s to the same error)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from training.config import ConfigError
from training.run import Run, execute_unit

RECIPE = "recipes.custom_loop:CustomLoopRecipe"


def source(make_config) -> str:
    """Run 'a' of the own-loop recipe with hidden=8, trained to its end: the state a new run starts from."""
    a = make_config(run_name="a", recipe=RECIPE, recipe_args={"num_samples": 64, "hidden": 8}, max_duration="1ep")
    with Run.open(a) as run:
        run.record(execute_unit(a, unit=0, generation=run.generation))
    return f"{a.save_folder}/a"


def test_a_state_that_does_not_fit_the_loops_model_is_a_config_error(make_config):
    load_path = source(make_config)
    b = make_config(run_name="b", recipe=RECIPE, recipe_args={"num_samples": 64, "hidden": 16}, load_path=load_path)
    with Run.open(b) as run, pytest.raises(ConfigError) as info:
        execute_unit(b, unit=0, generation=run.generation)
    assert str(info.value) == (
        f"recipe '{RECIPE}': train_loop loaded a state that does not fit its model (Error(s) in loading state_dict "
        f"for Sequential:); every attempt would fail the same way, so it is not retried. Check recipe and recipe_args "
        f"against the state ctx.get_checkpoint() returns (load_path={load_path!r}, or this run's newest report), or "
        f"start a new run_name"
    )


@pytest.mark.slow
def test_on_two_processes_the_cli_fails_once_with_exit_2_and_no_retry(make_config, prefect_env):
    load_path = source(make_config)
    argv = ["--run_name", "b", "--save_folder", make_config().save_folder, "--recipe", RECIPE, "--recipe_args",
            json.dumps({"num_samples": 64, "hidden": 16}), "--load_path", load_path, "--nproc_per_node", "2",
            "--unit_retries", "2", "--retry_delay_seconds", "30"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.train", *argv], cwd=ROOT, env=prefect_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith(
        f"error: recipe '{RECIPE}': train_loop loaded a state that does not fit its model (Error(s) in loading "
        f"state_dict for "
    ), done.stderr[-3000:]
    assert "Retry" not in done.stderr and "train_loop (attempt 2)" not in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 30 + 120  # a retry would first wait its 30 s or more (with jitter)
