"""A recipe the rank processes cannot import is refused before torchrun starts, not by every rank after its start.

The rank processes get this process's environment, not its ``sys.path``: a recipe found through a script's folder or a
notebook's ``sys.path.insert`` would fail on every rank some seconds later, each with its own traceback.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from training.config import ConfigError
from training.distributed.launcher import check_ranks_import
from training.recipe.loader import allow_recipe

RECIPE = textwrap.dedent(
    """
    from recipes.synthetic import SyntheticRecipe


    class ScriptRecipe(SyntheticRecipe):
        pass
    """
)


def _module_in(folder, name: str, monkeypatch) -> str:
    """A recipe module in ``folder`` that this process imports through its own sys.path only."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(RECIPE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    __import__(name)
    return f"{name}:ScriptRecipe"


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


def test_a_module_found_through_this_process_sys_path_only_is_refused_naming_its_folder(tmp_path, monkeypatch):
    recipe = _module_in(tmp_path / "scripts", "script_recipe_a", monkeypatch)
    with pytest.raises(ConfigError) as refused:
        check_ranks_import(recipe, _environment())
    message = str(refused.value)
    assert "cannot import it" in message
    assert f"PYTHONPATH={tmp_path / 'scripts'}" in message
    check_ranks_import(recipe, _environment(PYTHONPATH=str(tmp_path / "scripts")))  # the fix it names works


def test_a_module_the_ranks_would_import_from_another_file_is_refused(tmp_path, monkeypatch):
    recipe = _module_in(tmp_path / "mine", "script_recipe_b", monkeypatch)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "script_recipe_b.py").write_text(RECIPE)
    with pytest.raises(ConfigError, match="another file"):
        check_ranks_import(recipe, _environment(PYTHONPATH=str(tmp_path / "theirs")))


def test_an_installed_recipe_passes(monkeypatch):
    check_ranks_import("recipes.synthetic:SyntheticRecipe", _environment())


def test_a_run_on_two_processes_fails_before_torchrun_starts(tmp_path, monkeypatch, make_config, train_run):
    recipe = _module_in(tmp_path / "scripts", "script_recipe_c", monkeypatch)
    allow_recipe(recipe)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    config = make_config(recipe=recipe, nproc_per_node=2, max_duration="1ep")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"the rank processes .* cannot import it"):
        train_run(config)
    print(f"refused after {time.monotonic() - started:.2f} s")
    assert not list((tmp_path / "runs").rglob("manifest.json"))  # nothing trained
