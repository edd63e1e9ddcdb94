"""``export`` finds a checkpoint's weights under the names ``load_path`` accepts (one function, ``unwrap``): an own
loop's ``ctx.report(state={"model_weights": ...})`` (Ray's guides) exports as the train loop's ``["model"]`` does, and a
state with no weights says what was looked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from checkpointing import CheckpointStore, NotACheckpointError, Writer
from checkpointing.export import export_checkpoint
from checkpointing.peers.formats import read_weights
from recipes.synthetic import SyntheticRecipe
from tests.conftest import ROOT
from training.start.load_path import read_weights as load_path_weights

RECIPE = "recipes.synthetic:SyntheticRecipe"
LOOKED_FOR = "{'model_state_dict': ...} or {'model_weights': ...}"


def own_loop_run(root: str, state: dict) -> CheckpointStore:
    """A run whose checkpoint holds ``state`` as ``ctx.report(state=...)`` commits it (``state.pt``'s ``["state"]``)."""
    store = CheckpointStore(root, "own")
    store.save("ep3-ba12-sa96", {"state.pt": {"state": state}}, progress={"epoch": 3, "step": 12, "samples_seen": 96},
               metadata={"recipe": RECIPE}, writer=Writer.current(1))  # fmt: skip
    return store


@pytest.mark.parametrize("key", ["model_weights", "model_state_dict", "model"])
def test_an_own_loops_weights_export_under_the_key_load_path_reads(tmp_path, make_config, key):
    torch.manual_seed(3)
    weights = SyntheticRecipe().build_model().state_dict()
    store = own_loop_run(str(tmp_path / "runs"), {key: weights, "epoch": 3})
    out = str(tmp_path / "model.pt")
    line = export_checkpoint(store.uri, out)
    assert line.startswith(f"exported the weights of {store.uri}/checkpoints/ep3-ba12-sa96 to {out}")
    exported = read_weights(out).state_dict
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    # load_path reads the same checkpoint's weights through the same function
    config = make_config(run_name="ft", load_path=store.uri, load_weights_only=True)
    found = load_path_weights(config)
    assert found is not None and all(torch.equal(found.peer.weights.state_dict[k], weights[k]) for k in weights)


def test_a_state_without_weights_is_refused_naming_what_was_looked_for(tmp_path):
    store = own_loop_run(str(tmp_path / "runs"), {"epoch": 3, "notes": "no tensors"})
    with pytest.raises(NotACheckpointError) as info:
        export_checkpoint(store.uri, str(tmp_path / "model.pt"))
    text = str(info.value)
    assert text.startswith(f"uri={store.uri!r}: no checkpoint there holds model weights; the newest that verifies: ")
    assert (
        "ep3-ba12-sa96/state.pt ['state']: holds no state_dict in a layout this reader knows (found a mapping of "
        "2 keys)" in text
    )
    assert LOOKED_FOR in text and "no tensors" not in text  # what was looked for; never the state's own content


def test_the_cli_exports_what_verify_calls_ok(tmp_path):
    weights = SyntheticRecipe().build_model().state_dict()
    store = own_loop_run(str(tmp_path / "runs"), {"model_weights": weights})
    cli = [sys.executable, "-m", "checkpointing"]
    verify = subprocess.run([*cli, "verify", store.uri], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stderr
    out = tmp_path / "model.safetensors"
    export = subprocess.run([*cli, "export", store.uri, str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert export.returncode == 0, export.stderr
    exported = read_weights(str(out)).state_dict
    assert all(torch.equal(exported[k], weights[k]) for k in weights)
