"""One seed per seeded scenario per run (tests/conftest.py ``seeds``, issue 47): TEST_SEED, or one drawn for the run
that every xdist worker draws alike; TEST_ALL_SEEDS=1 runs the scenario's whole fixed set; a failure says how to
replay it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import conftest
from tests.conftest import ROOT

FAILING = """
import pytest
from tests.conftest import seeds

@pytest.mark.parametrize("seed", seeds(1, 2, 3))
def test_scenario(seed):
    assert seed < 0
"""


def test_a_run_has_one_seed_per_scenario_and_all_of_them_on_request(monkeypatch):
    monkeypatch.setattr(conftest, "ALL_SEEDS", False)
    one = conftest.seeds(1, 2, 3)
    assert [p.values for p in one] == [(conftest.RUN_SEED,)] and one[0].id == f"seed={conftest.RUN_SEED}"
    monkeypatch.setattr(conftest, "ALL_SEEDS", True)
    every = conftest.seeds(1, 2, 3)
    assert [p.values[0] for p in every] == [1, 2, 3]
    assert all(m.name == "all_seeds" for p in one + every for m in p.marks)


def test_the_seed_is_test_seed_or_the_same_in_every_worker_of_a_run(monkeypatch):
    monkeypatch.setenv("TEST_SEED", "42")
    assert conftest._run_seed() == 42
    monkeypatch.setenv("TEST_SEED", "4x")
    with pytest.raises(pytest.UsageError, match="TEST_SEED='4x' is not a seed: give a whole number"):
        conftest._run_seed()
    monkeypatch.delenv("TEST_SEED")
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run-a")
    assert conftest._run_seed() == conftest._run_seed()
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run-b")
    assert len({conftest._run_seed() for _ in range(3)}) == 1


def test_a_failing_seeded_test_names_its_seed_and_how_to_replay_it(tmp_path):
    (tmp_path / "test_scenario.py").write_text(FAILING)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEST_", "PYTEST_"))}
    env.update(TEST_SEED="31337", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            "-o",
            "addopts=",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_scenario.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert "1 failed" in out and "test_scenario[seed=31337]" in out, out[-3000:]
    assert "seed 31337 (replay: TEST_SEED=31337)" in out, out[-3000:]  # the test's output
    assert "seed 31337: replay with TEST_SEED=31337 pytest '" in out, out[-3000:]  # the failure's section
