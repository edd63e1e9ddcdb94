"""MindSpore Transformers' habits: a weights-only copy at every save (its checkpoint_network folder), committed with
the checkpoint; its YAML key names at the top level of a config file answered with the TrainConfig field."""

from __future__ import annotations

import io

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.io.protocols import open_url
from recipes.synthetic import SyntheticRecipe
from training.config import ConfigError, load_config
from training.run import Run
from training.start.warm_start import load_weights
from training.unit.loop import run_unit


def test_every_checkpoint_carries_a_weights_file_under_its_manifest(make_config, backend):
    save_folder, options = backend
    config = make_config(save_folder=save_folder, storage_options=options or {}, max_duration="2ep",
                         save_network_weights=True)  # fmt: skip
    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
    store = CheckpointStore(save_folder, "r", storage_options=options)
    infos = store.list()
    assert [i.name for i in infos] == ["ep1-ba8-sa256", "ep2-ba16-sa512"]
    for info in infos:
        assert set(info.manifest.files) == {"state.pt", "rng-rank0.pt", "weights.pt"}  # vouched for, in its folder
        assert store.check(info, deep=True) == []
        fs, path = open_url(f"{info.uri}/weights.pt", options)
        weights = torch.load(io.BytesIO(fs.cat_file(path)), weights_only=True)  # a plain state_dict
        model = store.load(info, ["state.pt"]).objects["state.pt"]["state"]["model"]
        assert weights.keys() == model.keys() and all(torch.equal(weights[k], model[k]) for k in model)


def test_the_weights_file_is_verified_pruned_and_loadable_like_the_checkpoint(make_config, caplog):
    config = make_config(max_duration="2ep", save_network_weights=True, num_checkpoints_to_keep=1)
    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
    store = CheckpointStore(config.save_folder, "r")
    (newest,) = store.list()  # retention took the older checkpoint, its weights.pt with it
    assert newest.name == "ep2-ba16-sa512"

    fine_tune = make_config(run_name="ft", load_path=f"{newest.uri}/weights.pt")
    target = SyntheticRecipe().build_model()
    assert load_weights(fine_tune, target) == f"weights of {newest.uri}/weights.pt (load_path: a plain state_dict)"

    with open(f"{newest.uri}/weights.pt", "r+b") as f:  # damage the copy alone: the checkpoint no longer verifies
        f.seek(100)
        f.write(b"\x00" * 8)
    assert any(p.startswith("ep2-ba16-sa512/weights.pt: sha256") for p in store.check(newest, deep=True))


MINDSPORE_TOP_LEVEL = """\
seed: 3
epochs: 3
batch_size: 32
save_checkpoint_steps: 500
keep_checkpoint_max: 3
load_checkpoint: ./output/checkpoint
resume_training: true
run_mode: train
"""


def test_mindspore_keys_at_the_top_level_are_answered_with_the_field_to_write(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(MINDSPORE_TOP_LEVEL)
    with pytest.raises(ConfigError) as info:
        load_config(["--config_file", str(path)])
    assert str(info.value) == (
        f"config_file={str(path)!r}: MindSpore Transformers' key(s) are not TrainConfig fields; write "
        "epochs -> max_duration: '3ep', batch_size -> global_batch_size: 32, save_checkpoint_steps -> save_interval: "
        "'500ba', keep_checkpoint_max -> num_checkpoints_to_keep: 3, load_checkpoint -> load_path: "
        "'./output/checkpoint', resume_training -> autoresume: true (MindSpore's batch_size is per device: multiply "
        "it by the number of devices) instead; unknown: run_mode"
    )


def test_a_checkpoint_name_in_resume_training_is_resume_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("resume_training: llama2_7b_rank_0-20_2.ckpt\n")
    with pytest.raises(
        ConfigError, match=r"write resume_training -> resume_from: 'llama2_7b_rank_0-20_2.ckpt' instead$"
    ):
        load_config(["--config_file", str(path)])
