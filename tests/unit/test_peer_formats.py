"""Migration tests: checkpoints written by Composer, Lightning, transformers, Ray Train and MindSpore themselves
(tests/fixtures/peers, see its README) load with this product's reader, tensor for tensor, and their optimizer
state and progress come out as a run here needs them. No peer library is imported: CI does not install them."""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from checkpointing.peers.formats import is_weights_file, optimizer_state_for, read_peer_checkpoint, read_weights
from checkpointing.peers.safe_types import load_with_peer_types
from checkpointing.peers.weights import WeightsError, load_into
from recipes.synthetic import SyntheticRecipe
from tests.interop_stores import STORES, put, store_root, torch_bytes

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
RAY = next((PEERS / "ray").iterdir())
MS_FULL = PEERS / "mindspore" / "checkpoint" / "rank_0"
MS_NET = PEERS / "mindspore" / "checkpoint_network" / "rank_0"


def reference(name: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(PEERS / f"{name}.reference.safetensors")


def expected(name: str) -> dict:
    return json.loads((PEERS / f"{name}.expected.json").read_text())


def recipe_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of recipes.synthetic (the shape the fixtures' peers trained), freshly initialized."""
    torch.manual_seed(123)
    recipe = SyntheticRecipe()
    model = recipe.build_model()
    return model, recipe.build_optimizer(model)


def assert_loaded(model: nn.Module, ref: dict[str, torch.Tensor], prefix: str = "") -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, ref[prefix + key]), key


def assert_momentum(model: nn.Module, optimizer: torch.optim.Optimizer, ref: dict, key: str) -> None:
    for i, (name, param) in enumerate(model.named_parameters()):
        assert torch.equal(optimizer.state[param]["momentum_buffer"], ref[key.format(i=i, name=name)]), name


# -- Composer ----------------------------------------------------------------------------------------
def test_a_real_composer_checkpoint_loads_weights_optimizer_and_progress():
    peer = read_peer_checkpoint(str(PEERS / "composer" / "ep2.pt"))
    model, optimizer = recipe_model()
    report = load_into(model, peer.weights.state_dict)
    optimizer.load_state_dict(optimizer_state_for(peer, [n for n, _ in model.named_parameters()]))

    ref, facts = reference("composer"), expected("composer")
    assert report.ok and report.stripped_prefix == "module."  # ComposerClassifier keeps the network in .module
    assert_loaded(model, ref)
    assert_momentum(model, optimizer, ref, "momentum.{i}")
    assert [g["lr"] for g in optimizer.param_groups] == facts["lr"]
    assert peer.progress == {**facts["progress"], "global_batch_size": 16}
    assert peer.progress["samples_seen"] == 128 and peer.scheduler_state["last_epoch"] == 8
    assert peer.description == "a Composer checkpoint (composer 0.32.1)"
    assert any(item.startswith("rng (") for item in peer.left)


def test_composers_numpy_rng_and_timedeltas_are_read_as_tensors_and_timedeltas_without_numpy_code():
    state = load_with_peer_types((PEERS / "composer" / "ep2.pt").read_bytes(), "ep2.pt")
    kind, key, pos, *_ = state["rng"][0]["numpy"]  # np.random.get_state(): ('MT19937', uint32[624], pos, ...)
    assert kind == "MT19937" and pos == 624
    assert key.dtype == torch.uint32 and key.shape == (624,) and int(key[0]) == 42  # np.random.seed(42)'s key
    timestamp = state["state"]["timestamp"]["Timestamp"]
    assert type(timestamp["total_wct"]) is datetime.timedelta and timestamp["total_wct"] > datetime.timedelta(0)
    assert type(state["state"]["metadata"]["torch_version"]) is str  # TorchVersion, a str subclass, made plain


@pytest.mark.parametrize("kind", STORES)
def test_composers_latest_symlink_text_object_leads_to_the_checkpoint_beside_it(kind, request, tmp_path):
    root, options = store_root(kind, request, tmp_path)
    put(f"{root}/run/checkpoints/ep2.pt", (PEERS / "composer" / "ep2.pt").read_bytes(), options)
    bucket_path = root.split("://", 1)[-1].split("/", 1)[-1]  # Composer writes the object name, bucket left out
    put(f"{root}/run/checkpoints/latest-rank0.pt.symlink", f"{bucket_path}/run/checkpoints/ep2.pt".encode(), options)
    peer = read_peer_checkpoint(f"{root}/run/checkpoints/latest-rank0.pt.symlink", options)
    assert peer.progress["step"] == 8 and torch.equal(
        peer.weights.state_dict["module.0.weight"], reference("composer")["0.weight"]
    )


# -- Lightning ---------------------------------------------------------------------------------------
def test_a_real_lightning_last_ckpt_loads_weights_optimizer_progress_and_hyper_parameters():
    peer = read_peer_checkpoint(str(PEERS / "lightning" / "last.ckpt"))
    model, optimizer = recipe_model()
    report = load_into(model, peer.weights.state_dict)
    optimizer.load_state_dict(optimizer_state_for(peer, [n for n, _ in model.named_parameters()]))

    ref, facts = reference("lightning"), expected("lightning")
    assert report.ok and report.stripped_prefix == "model."
    assert_loaded(model, ref, prefix="model.")
    assert_momentum(model, optimizer, ref, "momentum.{i}")
    assert peer.progress == facts["progress"] == {"epoch": 2, "step": 8}  # saved with 'epoch': 1, at epoch end
    hparams = peer.extras["hyper_parameters"]
    assert hparams["data_dir"] == pathlib.PurePosixPath("data/tiny") and not isinstance(hparams["data_dir"], Path)
    assert hparams["budget"] == datetime.timedelta(hours=1) and hparams["ratio"] == 0.5
    assert peer.scheduler_state["step_size"] == 3


def test_a_lightning_weights_only_checkpoint_gives_weights_and_progress_but_no_optimizer():
    peer = read_peer_checkpoint(str(PEERS / "lightning" / "weights_only.ckpt"))
    model, _ = recipe_model()
    load_into(model, peer.weights.state_dict)
    assert_loaded(model, reference("lightning"), prefix="model.")
    assert peer.optimizer_state is None and peer.progress == {"epoch": 2, "step": 8}


# -- Hugging Face ------------------------------------------------------------------------------------
def gpt2_like(shapes: dict[str, torch.Size], tied: dict[str, str]) -> nn.Module:
    """A module with the tiny GPT-2's keys and shapes and its tied head (transformers is not installed in CI)."""
    root = nn.Module()
    params: dict[str, nn.Parameter] = {}
    for key, shape in sorted(shapes.items(), key=lambda item: item[0] in tied):  # tied keys after their targets
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        params[key] = params[tied[key]] if key in tied else nn.Parameter(torch.zeros(shape))
        module.register_parameter(leaf, params[key])
    return root


@pytest.mark.parametrize("folder", ["single", "sharded"])
def test_a_save_pretrained_folder_loads_into_a_model_with_a_tied_head(folder):
    ref, facts = reference("hf"), expected("hf")
    path = str(PEERS / "hf" / folder)
    model = gpt2_like({k: v.shape for k, v in ref.items()}, facts["tied"])

    assert is_weights_file(path)
    peer = read_peer_checkpoint(path)
    assert "lm_head.weight" not in peer.weights.state_dict  # transformers writes one of two tied tensors
    report = load_into(model, peer.weights.state_dict)
    assert report.ok
    assert_loaded(model, ref)  # lm_head.weight too, through the tie
    assert peer.optimizer_state is None and peer.progress is None


def test_without_the_tie_the_missing_head_is_named():
    ref = reference("hf")
    untied = gpt2_like({k: v.shape for k, v in ref.items()}, {})
    with pytest.raises(WeightsError, match=r"1 missing from the file \('lm_head.weight'\)"):
        load_into(untied, read_weights(str(PEERS / "hf" / "single")).state_dict)


def test_either_key_of_a_tied_pair_fills_both():
    ref, tied = reference("hf"), expected("hf")["tied"]
    model = gpt2_like({k: v.shape for k, v in ref.items()}, tied)
    only_head = {k: v for k, v in ref.items() if k != "transformer.wte.weight"}  # the other key of the pair
    assert load_into(model, only_head).ok
    assert_loaded(model, ref)


def test_the_real_transformers_model_takes_the_folder_when_transformers_is_installed():
    transformers = pytest.importorskip("transformers")  # not in CI: the keyed stand-in above covers it there
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**expected("hf")["config"]))
    load_into(model, read_weights(str(PEERS / "hf" / "sharded")).state_dict)
    assert_loaded(model, reference("hf"))


@pytest.mark.parametrize("sharded", [False, True], ids=["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_the_transformers_4_pytorch_model_bin_layout_loads(sharded, tmp_path):
    ref = reference("hf")
    tensors = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    if sharded:  # transformers 4.x: torch.save per shard, and the index that names them
        keys = sorted(tensors)
        shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
        for name, part in shards.items():
            (tmp_path / name).write_bytes(torch_bytes({k: tensors[k] for k in part}))
        weight_map = {k: name for name, part in shards.items() for k in part}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        (tmp_path / "pytorch_model.bin").write_bytes(torch_bytes(tensors))
    (tmp_path / "config.json").write_text("{}")
    model = gpt2_like({k: v.shape for k, v in ref.items()}, expected("hf")["tied"])
    load_into(model, read_weights(str(tmp_path)).state_dict)
    assert_loaded(model, ref)


# -- Ray Train ---------------------------------------------------------------------------------------
def test_a_ray_train_checkpoint_folder_loads_its_torch_save_file_with_numpy_datetime_and_path_values():
    assert is_weights_file(str(RAY))
    peer = read_peer_checkpoint(str(RAY))
    model, optimizer = recipe_model()
    load_into(model, peer.weights.state_dict)
    optimizer.load_state_dict(optimizer_state_for(peer, [n for n, _ in model.named_parameters()]))

    ref = reference("ray")
    assert_loaded(model, ref)
    assert_momentum(model, optimizer, ref, "momentum.{i}")
    assert peer.description.startswith("a folder holding one weights file, as Ray Train's checkpoints do")
    assert peer.extras["saved_at"] == datetime.datetime(2026, 11, 24, 10, 0, tzinfo=datetime.UTC)
    assert peer.extras["data_dir"] == pathlib.PurePosixPath("data/tiny") and type(peer.extras["loss"]) is float
    assert peer.progress is None and any("'epoch': 1, 'step': 8" in item for item in peer.left)


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("folder", [PEERS / "hf" / "sharded", RAY], ids=["hf sharded", "ray"])
def test_peer_folders_load_from_every_store(kind, folder, request, tmp_path):
    root, options = store_root(kind, request, tmp_path)
    for file in folder.iterdir():
        put(f"{root}/{folder.name}/{file.name}", file.read_bytes(), options)
    uri = f"{root}/{folder.name}"
    assert is_weights_file(uri, options)
    local = read_weights(str(folder)).state_dict
    remote = read_weights(uri, options).state_dict
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)


# -- MindSpore ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_a_mindspore_checkpoint_loads_weights_momentum_and_progress(fmt):
    peer = read_peer_checkpoint(str(MS_FULL / f"tiny_rank_0-2_4.{fmt}"))
    model, optimizer = recipe_model()
    report = load_into(model, peer.weights.state_dict)  # strict: the optimizer's slots are not weights
    optimizer.load_state_dict(optimizer_state_for(peer, [n for n, _ in model.named_parameters()]))

    ref = reference("mindspore")
    assert report.ok
    assert_loaded(model, ref, prefix=f"{fmt}/")
    assert_momentum(model, optimizer, ref, fmt + "/moments.{name}")
    assert optimizer.param_groups[0]["momentum"] == pytest.approx(0.9) and peer.progress == {"epoch": 2, "step": 8}


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_mindspores_weights_only_copy_loads_weights_alone(fmt):
    peer = read_peer_checkpoint(str(MS_NET / f"tiny_rank_0-2_4.{fmt}"))
    model, _ = recipe_model()
    assert load_into(model, peer.weights.state_dict).ok
    assert_loaded(model, reference("mindspore"), prefix=f"{fmt}/")
    assert peer.optimizer_state is None and peer.progress is None


# -- the options apply to the new formats --------------------------------------------------------------
def test_load_strict_and_load_ignore_keys_apply_to_a_peer_file():
    weights = read_weights(str(PEERS / "composer" / "ep2.pt")).state_dict
    wider = SyntheticRecipe(num_classes=5).build_model()
    with pytest.raises(WeightsError, match=r"2 of another shape \('3.bias' file \[4\] vs model \[5\]"):
        load_into(wider, weights)
    report = load_into(wider, weights, ignore_keys=["3.*"])
    assert report.ok and report.ignored == ["3.bias", "3.weight"] and report.stripped_prefix == "module."
    assert torch.equal(wider.state_dict()["0.weight"], reference("composer")["0.weight"])


# -- folders: peers' and ours --------------------------------------------------------------------------
def test_our_run_and_checkpoint_folders_are_never_taken_for_peer_folders(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "ep1").mkdir(parents=True)
    shutil.copy(PEERS / "hf" / "single" / "model.safetensors", run / "model.safetensors")
    (run / "checkpoints" / "ep1" / "manifest.json").write_text("{}")
    shutil.copy(RAY / "checkpoint.pt", run / "checkpoints" / "ep1" / "state.pt")
    assert not is_weights_file(str(run))  # a run folder, even with a model.safetensors in it
    assert not is_weights_file(str(run / "checkpoints" / "ep1"))  # a checkpoint folder (manifest.json)
    (tmp_path / "empty").mkdir()
    assert not is_weights_file(str(tmp_path / "empty"))


def test_a_folder_with_several_weights_files_is_refused_naming_them(tmp_path):
    for name in ("a.pt", "b.pt"):
        shutil.copy(RAY / "checkpoint.pt", tmp_path / name)
    assert is_weights_file(str(tmp_path))
    with pytest.raises(WeightsError, match=r"a folder with 2 weights files \('a.pt', 'b.pt'\); name the one to load"):
        read_weights(str(tmp_path))


# -- end to end: a run of this product continues from a peer's file ------------------------------------
@pytest.mark.parametrize("file", ["composer/ep2.pt", "lightning/last.ckpt"])
def test_a_run_trains_from_a_peers_checkpoint_through_run_unit(file, make_config):
    from training.unit.loop import run_unit  # the unit's Prefect-free path, as train_unit runs it

    ref = reference(file.split("/")[0])
    prefix = "model." if file.startswith("lightning") else ""
    # the file's progress is carried (Composer's step 8 at 16 a batch is step 4 at 32; Lightning's 8 steps in 2 epochs
    # of 256 samples, 64 a batch, are step 16 at 32): 20ba is past both
    frozen = make_config(run_name="frozen", load_path=str(PEERS / file), max_duration="20ba", save_interval="2ba",
                         recipe_args={"num_samples": 256, "lr": 0.0})  # fmt: skip
    result = run_unit(frozen)
    assert result.origin == "load_path" and result.steps == 2
    weights = read_weights(result.checkpoint + "/state.pt").state_dict  # our own checkpoint, read back
    # lr=0, this run's (it wins over the file's 0.05): the peer's weights, unchanged
    assert all(torch.equal(weights[k], ref[prefix + k]) for k in weights)

    moving = frozen.model_copy(update={"run_name": "moving", "recipe_args": {"num_samples": 256}})
    weights = read_weights(run_unit(moving).checkpoint + "/state.pt").state_dict
    assert any(not torch.equal(weights[k], ref[prefix + k]) for k in weights)  # and training moves them on
