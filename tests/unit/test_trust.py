"""A run's parameters never choose code: recipes come from the worker's allow-list, checked before import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, TEST_RECIPES
from training.config import ConfigError, TrainConfig
from training.recipe.loader import allowed_recipes, load_recipe, recipe_class


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "evil-marker"
    monkeypatch.setenv("EVIL_MARKER", str(path))
    sys.modules.pop("tests.evil_recipe", None)
    return path


def test_a_recipe_outside_the_allow_list_is_refused_before_its_module_is_imported(marker):
    with pytest.raises(ConfigError) as info:
        load_recipe(TrainConfig(recipe="tests.evil_recipe:NotARecipe"))
    assert str(info.value).startswith("recipe='tests.evil_recipe:NotARecipe' is not allowed on this worker")
    assert "TRAIN_ALLOWED_RECIPES" in str(info.value)
    assert not marker.exists() and "tests.evil_recipe" not in sys.modules


@pytest.mark.parametrize("path", ["os:system", "subprocess:Popen", "builtins:exec", "shutil:rmtree"])
def test_standard_library_callables_are_not_recipes_a_run_may_name(path):
    with pytest.raises(ConfigError, match=f"recipe='{path}' is not allowed on this worker"):
        load_recipe(TrainConfig(recipe=path, recipe_args={"args": "touch /tmp/pwned"}))


def test_an_allowed_class_that_is_not_a_recipe_is_refused_before_it_is_called(marker, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAIN_ALLOWED_RECIPES", f"{TEST_RECIPES},tests.evil_recipe:NotARecipe")
    target = tmp_path / "target"
    with pytest.raises(ConfigError, match=r"tests\.evil_recipe:NotARecipe is not a recipe: no build_model"):
        load_recipe(TrainConfig(recipe="tests.evil_recipe:NotARecipe", recipe_args={"path": str(target)}))
    assert marker.read_text() == "imported\n"  # allowed, so imported; never called
    assert not target.exists()


def test_registered_names_and_environment_entries_resolve_to_their_classes(monkeypatch):
    monkeypatch.setenv(
        "TRAIN_ALLOWED_RECIPES", "mine=recipes.digits:DigitsRecipe, tests.recipes_for_tests:RecordingRecipe"
    )
    allowed = allowed_recipes()
    assert allowed["digits"] == "recipes.digits:DigitsRecipe"  # the package's entry point
    assert allowed["mine"] == "recipes.digits:DigitsRecipe"
    assert recipe_class(TrainConfig(recipe="mine")).__name__ == "DigitsRecipe"
    assert recipe_class(TrainConfig(recipe="synthetic")).__name__ == "SyntheticRecipe"
    assert recipe_class(TrainConfig(recipe="tests.recipes_for_tests:RecordingRecipe")).__name__ == "RecordingRecipe"


def test_a_malformed_allow_list_entry_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRAIN_ALLOWED_RECIPES", "os.system")
    with pytest.raises(ConfigError, match=r"TRAIN_ALLOWED_RECIPES: 'os\.system' is not an import path"):
        allowed_recipes()


@pytest.mark.slow  # two python processes that import torch
def test_the_command_line_allows_the_recipe_it_names_for_its_own_process_only(tmp_path):
    """`python -m flows.train --recipe pkg:Cls` by hand may run it; the allow-list of other processes is unchanged."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "home")}
    code = (
        "import sys; from training.recipe.loader import allow_recipe, resolve_recipe;"
        "allow_recipe('tests.recipes_for_tests:RecordingRecipe');"
        "print(resolve_recipe('tests.recipes_for_tests:RecordingRecipe'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "tests.recipes_for_tests:RecordingRecipe", proc.stderr
    refuse = (
        "from training.recipe.loader import resolve_recipe; resolve_recipe('tests.recipes_for_tests:RecordingRecipe')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", refuse], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "is not allowed on this worker" in proc.stderr
