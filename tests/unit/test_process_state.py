"""What a process keeps across units is listed once (training/process_state.py), and ``reset()`` forgets all of it."""

from __future__ import annotations

import random

from checkpointing.io import confine
from training import preemption, process_state
from training.metrics import log as metrics_log
from training.recipe import loader
from training.start import preflight, warm_start
from training.unit import rng
from training.unit.loop import BUDGETS


def test_reset_forgets_everything_a_process_keeps_across_units():
    original = random.random
    preemption.STOP.request("signal", "a test")
    loader.allow_recipe("tests.recipes_for_tests:RecordingRecipe")
    preflight._passed.add("a config")
    warm_start._passed.add("a load_path")
    BUDGETS["memory://a-run"] = object()  # type: ignore[assignment]
    rng.own_python_random()
    confine.enter(["/nowhere"])
    closed = []
    metrics_log._LOGS["memory://a-run"] = type("Log", (), {"close": lambda self: closed.append(1)})()

    process_state.reset()

    assert preemption.STOP.current is None and not loader._allowed_in_process
    assert not preflight._passed and not warm_start._passed and not BUDGETS
    assert rng._owner is None and random.random == original  # every thread draws from random's own generator again
    assert confine.local_roots() is None
    assert not metrics_log._LOGS and closed == [1]  # every run's TensorBoard writer closed


def test_reset_of_a_fresh_process_changes_nothing():
    process_state.reset()
    process_state.reset()
    assert preemption.STOP.current is None and rng._owner is None
