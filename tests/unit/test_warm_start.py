"""load_path weights checked against the recipe's model before a run writes anything, then loaded and logged."""

from __future__ import annotations

import logging
import os

import pytest
import safetensors.torch
import torch

from checkpointing import CheckpointStore
from recipes.synthetic import SyntheticRecipe
from tests.interop_stores import torch_bytes
from training.config import ConfigError, TrainConfig
from training.start.warm_start import check_load_path, load_weights

RECIPE = "recipes.synthetic:SyntheticRecipe"


def config(load_path: str, **overrides) -> TrainConfig:
    return TrainConfig(recipe=RECIPE, load_path=load_path, **overrides)


@pytest.fixture
def weights_file(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    sd = SyntheticRecipe().build_model().state_dict()
    path = tmp_path / "w.safetensors"
    path.write_bytes(safetensors.torch.save(sd))
    return str(path), sd


def test_a_file_that_fits_the_model_passes_the_check_and_loads_equal_weights(weights_file):
    path, sd = weights_file
    check_load_path(config(path))
    target = SyntheticRecipe().build_model()
    origin = load_weights(config(path), target)
    assert origin == f"weights of {path} (load_path: a safetensors file)"
    assert all(torch.equal(target.state_dict()[k], v) for k, v in sd.items())


def test_the_check_refuses_a_mismatch_with_the_recipe_model_in_one_config_error(weights_file):
    path, _ = weights_file
    with pytest.raises(ConfigError) as info:
        check_load_path(config(path, recipe_args={"num_classes": 5}))
    assert str(info.value) == (
        f"load_path={path!r}: the weights do not match the model: 2 of another shape ('3.bias' file [4] vs model "
        f"[5], '3.weight' file [4, 32] vs model [5, 32]); set load_strict=false to load the keys that match, or "
        f"load_ignore_keys=['3.*'] to leave keys out"
    )
    check_load_path(config(path, recipe_args={"num_classes": 5}, load_ignore_keys=["3.*"]))  # the fix it names


def test_the_check_turns_a_code_running_pickle_into_a_config_error(tmp_path):
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "evil.pt").write_bytes(torch_bytes(Payload()))
    with pytest.raises(ConfigError, match=r"refused: the file needs code to load"):
        check_load_path(config(str(tmp_path / "evil.pt")))
    assert not marker.exists()


def test_strict_options_on_a_full_state_folder_are_refused(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "src")
    store.save("ep1-ba1-sa1", {"state.pt": {"state": {"model": {}}}}, progress={"samples_seen": 1})
    with pytest.raises(
        ConfigError, match="load_strict and load_ignore_keys apply to weights: set load_weights_only=true"
    ):
        check_load_path(config(store.uri, load_strict=False))


def test_non_strict_load_logs_how_many_keys_were_skipped_and_missing(weights_file, caplog):
    path, _ = weights_file
    with caplog.at_level(logging.INFO, logger="training.start.warm_start"):
        load_weights(
            config(path, recipe_args={"num_classes": 5}, load_strict=False),
            SyntheticRecipe(num_classes=5).build_model(),
        )
    assert caplog.messages == [
        "load_path is a weights file: weights only; optimizer, scheduler and progress start fresh",
        "load_path: loaded 2 of the model's 4 keys; skipped 2 keys of the file (0 by load_ignore_keys, 0 not in "
        "the model, 2 of another shape); 2 model keys keep their initialization (0 of them missing from the file) "
        "(a safetensors file)",
    ]
