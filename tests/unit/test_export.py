"""Exports carry what rebuilds the model: export -> recipe(**recipe_args).build_model() -> the same tensors,
in both formats, on local, memory:// and S3 over HTTP (moto)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading

import pytest
import safetensors
import torch

from checkpointing import CheckpointStore, Writer
from checkpointing.export import export_checkpoint
from checkpointing.peers.formats import read_weights
from checkpointing.peers.weights import load_into
from recipes.synthetic import SyntheticRecipe
from tests.conftest import ROOT
from tests.interop_stores import STORES, store_root
from training.config import TrainConfig
from training.recipe.loader import load_recipe

RECIPE = "recipes.synthetic:SyntheticRecipe"
ARGS = {"hidden": 8, "num_layers": 3}  # not the defaults: a rebuild without them would not fit


def make_run(root: str, options: dict, metadata: dict) -> tuple[CheckpointStore, dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    weights = SyntheticRecipe(**ARGS).build_model().state_dict()
    store = CheckpointStore(root, "exp", storage_options=options)
    store.save(
        "ep2-ba16-sa512",
        {"state.pt": {"state": {"model": weights, "optimizer": {}}}},
        progress={"epoch": 2, "step": 16, "samples_seen": 512},
        metadata=metadata,
        writer=Writer.current(1),
    )
    return store, weights


def rebuild(uri: str, options: dict) -> tuple[torch.nn.Module, dict]:
    """What a user with only the export and the recipe's code does."""
    exported = read_weights(uri, options)
    meta = exported.metadata
    model = load_recipe(TrainConfig(recipe=meta["recipe"], recipe_args=meta["recipe_args"])).build_model()
    load_into(model, exported.state_dict, strict=True)
    return model, meta


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("kind", STORES)
def test_export_and_the_recipe_rebuild_the_checkpoints_model_exactly(kind, fmt, request, tmp_path):
    root, options = store_root(kind, request, tmp_path)
    store, weights = make_run(root, options, {"recipe": RECIPE, "config": {"recipe_args": ARGS}})
    out = f"{root}/export/model.{'safetensors' if fmt == 'safetensors' else 'pt'}"

    line = export_checkpoint(store.uri, out, storage_options=options)
    model, meta = rebuild(out, options)

    assert line.startswith(f"exported the weights of {store.uri}/checkpoints/ep2-ba16-sa512 to {out} (")
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert meta["recipe"] == RECIPE and meta["recipe_args"] == ARGS
    assert meta["product_version"] == importlib.metadata.version("resumable-train")
    assert meta["checkpoint"] == f"{store.uri}/checkpoints/ep2-ba16-sa512"
    assert meta["progress"] == {"epoch": 2, "step": 16, "samples_seen": 512}


def test_recipe_args_written_at_the_top_of_the_metadata_are_found_too(tmp_path):
    store, weights = make_run(str(tmp_path / "runs"), {}, {"recipe": RECIPE, "recipe_args": ARGS})
    export_checkpoint(store.uri, str(tmp_path / "m.pt"))
    model, meta = rebuild(str(tmp_path / "m.pt"), {})
    assert meta["recipe_args"] == ARGS
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_cli_export_safetensors_is_readable_with_safetensors_own_api(tmp_path):
    store, weights = make_run(str(tmp_path / "runs"), {}, {"recipe": RECIPE, "config": {"recipe_args": ARGS}})
    out = tmp_path / "model.bin"  # no telling suffix: --format decides
    proc = subprocess.run(
        [sys.executable, "-m", "checkpointing", "export", store.uri, str(out), "--format", "safetensors"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert meta["recipe"] == RECIPE and json.loads(meta["recipe_args"]) == ARGS
    assert meta["product_version"] == importlib.metadata.version("resumable-train")
    assert tensors.keys() == weights.keys() and all(torch.equal(tensors[k], v) for k, v in weights.items())


def test_export_replaces_a_symlink_at_the_name_instead_of_writing_through_it(tmp_path):
    store, _ = make_run(str(tmp_path / "runs"), {}, {"recipe": RECIPE})
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, tmp_path / "model.pt")

    export_checkpoint(store.uri, str(tmp_path / "model.pt"))

    assert victim.read_text() == "keep me"
    assert not os.path.islink(tmp_path / "model.pt") and (tmp_path / "model.pt").stat().st_size > 0


def test_export_onto_a_fifo_replaces_it_without_blocking(tmp_path):
    store, weights = make_run(str(tmp_path / "runs"), {}, {"recipe": RECIPE})
    os.mkfifo(tmp_path / "model.pt")
    thread = threading.Thread(target=export_checkpoint, args=(store.uri, str(tmp_path / "model.pt")), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "export blocked on a FIFO"
    assert torch.equal(read_weights(str(tmp_path / "model.pt")).state_dict["0.weight"], weights["0.weight"])
