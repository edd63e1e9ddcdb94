"""MindSpore Transformers' own output as ``load_path``: ``output/checkpoint`` (rank folders) and ``rank_<r>/`` folders
with several ``{prefix}-{epoch}_{step}.ckpt`` files and a ``meta.json`` naming the newest, built from the files the real
MindSpore 2.10.0 wrote (tests/fixtures/peers/mindspore); a missing, damaged or hostile ``meta.json`` falls back to the
newest file by name; the step a MindSpore file carries is counted in this run's batches, as a native run's is."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from checkpointing import CheckpointStore
from checkpointing.peers.formats import read_peer_checkpoint
from checkpointing.peers.weights import WeightsError
from training.config import ConfigError, load_config
from training.position.progress import Progress
from training.run import Run
from training.start.warm_start import check_load_path
from training.unit.loop import run_unit
from training.unit.session import restore

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers" / "mindspore"
CKPT = PEERS / "checkpoint" / "rank_0" / "tiny_rank_0-2_4.ckpt"  # one MindSpore run
NETWORK = PEERS / "checkpoint_network" / "rank_0" / "tiny_rank_0-2_4.ckpt"
REF = safetensors.torch.load_file(PEERS.parent / "mindspore.reference.safetensors")
NAMES = ["0.weight", "0.bias", "3.weight", "3.bias"]
NEWEST, OLDER = "tiny_rank_0-10_4.ckpt", "tiny_rank_0-9_4.ckpt"  # by {epoch}_{step}; by text, 9 sorts last
# An older file that loads to other weights: MindSpore's file with the bytes of its '3.bias' changed (no CRC in it)
OLDER_BIAS = torch.tensor([1.0, 2.0, 3.0, 4.0])
OLDER_BYTES = CKPT.read_bytes().replace(REF["ckpt/3.bias"].numpy().tobytes(), OLDER_BIAS.numpy().tobytes())


def output_tree(root: Path, meta: dict | None = None, ranks: int = 2) -> Path:
    """``root/output`` as a MindSpore Transformers run leaves it: per rank the newest file (MindSpore's) and an
    older one (``OLDER_BYTES``), written newest first so that neither mtime nor text order picks the newest;
    ``meta.json`` per rank (``meta`` for it, default: naming the newest); ``checkpoint_network/`` beside."""
    assert OLDER_BYTES.count(OLDER_BIAS.numpy().tobytes()) == 1 and len(OLDER_BYTES) == CKPT.stat().st_size
    for rank in range(ranks):
        folder = root / "output" / "checkpoint" / f"rank_{rank}"
        folder.mkdir(parents=True)
        shutil.copy(CKPT, folder / NEWEST.replace("rank_0", f"rank_{rank}"))
        (folder / OLDER.replace("rank_0", f"rank_{rank}")).write_bytes(OLDER_BYTES)
        name = NEWEST.replace("rank_0", f"rank_{rank}")
        record = meta if meta is not None else {"last_epoch": 10, "last_step": 4, "last_ckpt_file": name}
        (folder / "meta.json").write_text(json.dumps(record))
        network = root / "output" / "checkpoint_network" / f"rank_{rank}"
        network.mkdir(parents=True)
        shutil.copy(NETWORK, network / NEWEST.replace("rank_0", f"rank_{rank}"))
    return root / "output"


def newest_weights() -> dict[str, torch.Tensor]:
    return {n: REF[f"ckpt/{n}"] for n in NAMES}


def older_weights() -> dict[str, torch.Tensor]:
    return {**newest_weights(), "3.bias": OLDER_BIAS}


def loaded_weights(uri: str) -> dict[str, torch.Tensor]:
    return read_peer_checkpoint(uri).weights.state_dict


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(config) -> Run:
    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
    return run


# -- the seed's resume configuration, as written -------------------------------------------------------------------
def test_the_path_our_yaml_error_suggests_loads_rank_0s_file_that_meta_json_names(tmp_path, monkeypatch, make_config):
    output_tree(tmp_path)
    yaml = tmp_path / "run.yaml"
    yaml.write_text("load_checkpoint: './output/checkpoint'\n")
    with pytest.raises(ConfigError, match=r"load_checkpoint -> load_path: './output/checkpoint'"):
        load_config(["--config_file", str(yaml)])
    monkeypatch.chdir(tmp_path)  # the user's working folder, as MindSpore's relative path means it
    config = make_config(run_name="from-ms", load_path="./output/checkpoint", max_duration="3ep")
    check_load_path(config)  # the flow's check before anything is written: not "neither a checkpoint folder ..."
    session, origin = restore(config, CheckpointStore(config.save_folder, config.run_name))
    assert origin.kind == "load_path" and "rank_0 of a MindSpore Transformers checkpoint folder" in origin.text
    for name, param in session.model.named_parameters():  # the .ckpt run's weights and nn.Momentum's moments
        assert torch.equal(param.detach(), REF[f"ckpt/{name}"]), name
        assert torch.equal(session.optimizer.state[param]["momentum_buffer"], REF[f"ckpt/moments.{name}"]), name


def test_meta_json_decides_even_when_it_names_an_older_file(tmp_path):
    out = output_tree(tmp_path, {"last_epoch": 9, "last_step": 4, "last_ckpt_file": OLDER})
    assert same(loaded_weights(str(out / "checkpoint")), older_weights())
    assert same(loaded_weights(str(out / "checkpoint" / "rank_0")), older_weights())
    assert same(loaded_weights(str(out / "checkpoint") + "/"), older_weights())


def test_a_rank_folder_reads_its_own_meta_json_and_checkpoint_network_its_newest_file(tmp_path, caplog):
    out = output_tree(tmp_path)
    rank_1 = out / "checkpoint" / "rank_1"
    assert same(loaded_weights(str(rank_1)), newest_weights())
    peer = read_peer_checkpoint(str(rank_1))
    assert peer.description.startswith(
        f"a MindSpore Transformers rank folder, the file its meta.json names ('{NEWEST.replace('rank_0', 'rank_1')}')"
    )
    with caplog.at_level(logging.WARNING):
        network = read_peer_checkpoint(str(out / "checkpoint_network"))
    assert same(network.weights.state_dict, newest_weights()) and network.optimizer_state is None
    assert "meta.json is missing; took the newest file by the {epoch}_{step} in its name instead" in caplog.text


def test_a_checkpoint_folder_without_rank_0_is_refused_naming_its_rank_folders(tmp_path):
    out = output_tree(tmp_path)
    shutil.rmtree(out / "checkpoint" / "rank_0")
    with pytest.raises(
        WeightsError, match=r"a MindSpore checkpoint folder without a rank_0 folder \(it holds 'rank_1'\)"
    ):
        read_peer_checkpoint(str(out / "checkpoint"))


# -- meta.json missing, damaged or hostile: the newest file by name, and a warning that says so -----------------------
OUTSIDE = "outside-9_4.ckpt"


@pytest.mark.parametrize(
    "meta, problem",
    [
        (None, "is missing"),
        (b'{"last_epoch": 10, ', "is not JSON"),
        (b"\xff\xfe not text", "is not JSON"),
        (b'[10, 4, "x.ckpt"]', "is not {'last_epoch': int, 'last_step': int, 'last_ckpt_file': file name}"),
        ({"last_epoch": "10", "last_step": 4, "last_ckpt_file": NEWEST}, "is not {'last_epoch': int"),
        ({"last_epoch": True, "last_step": 4, "last_ckpt_file": NEWEST}, "is not {'last_epoch': int"),
        ({"last_epoch": 10, "last_step": -4, "last_ckpt_file": NEWEST}, "is not {'last_epoch': int"),
        ({"last_epoch": 9, "last_step": 4, "last_ckpt_file": f"../outside/{OUTSIDE}"}, "names a path, not a file"),
        ({"last_epoch": 9, "last_step": 4, "last_ckpt_file": "/etc/passwd-9_4.ckpt"}, "names a path, not a file"),
        ({"last_epoch": 9, "last_step": 4, "last_ckpt_file": "..\\outside-9_4.ckpt"}, "names a path, not a file"),
        ({"last_epoch": 9, "last_step": 4, "last_ckpt_file": "gone-9_4.ckpt"}, "names a file that is not one of"),
        ({"last_epoch": 7, "last_step": 1, "last_ckpt_file": OLDER}, "names a file whose {epoch}_{step} differs"),
        (b" " * (64 << 10) + b"{}", "is unreadable"),
    ],
)
def test_a_damaged_or_hostile_meta_json_falls_back_to_the_newest_file_by_name(tmp_path, caplog, meta, problem):
    out = output_tree(tmp_path)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / OUTSIDE).write_bytes(OLDER_BYTES)
    rank_0 = out / "checkpoint" / "rank_0"
    if meta is None:
        (rank_0 / "meta.json").unlink()
    else:
        (rank_0 / "meta.json").write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    with caplog.at_level(logging.WARNING):
        assert same(loaded_weights(str(out / "checkpoint")), newest_weights())  # the newest by name, not meta's
    assert f"meta.json {problem}" in caplog.text
    assert f"took the newest file by the {{epoch}}_{{step}} in its name instead: '{NEWEST}'" in caplog.text
    assert "passwd" not in caplog.text and "outside" not in caplog.text  # its content is never quoted back


def test_meta_json_that_is_a_link_is_not_followed(tmp_path, caplog):
    out = output_tree(tmp_path)
    rank_0 = out / "checkpoint" / "rank_0"
    planted = tmp_path / "planted.json"  # a sound record, elsewhere: it would pick the older file
    planted.write_text(json.dumps({"last_epoch": 9, "last_step": 4, "last_ckpt_file": OLDER}))
    (rank_0 / "meta.json").unlink()
    os.symlink(planted, rank_0 / "meta.json")
    with caplog.at_level(logging.WARNING):
        assert same(loaded_weights(str(rank_0)), newest_weights())
    assert "meta.json is a link, not followed" in caplog.text


def test_a_checkpoint_file_that_is_a_link_out_of_the_folder_is_never_chosen(tmp_path, caplog):
    out = output_tree(tmp_path)
    rank_0 = out / "checkpoint" / "rank_0"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.ckpt").write_bytes(OLDER_BYTES)
    os.symlink(tmp_path / "elsewhere" / "x.ckpt", rank_0 / "tiny_rank_0-99_4.ckpt")  # the newest by name
    (rank_0 / "meta.json").write_text(
        json.dumps({"last_epoch": 99, "last_step": 4, "last_ckpt_file": "tiny_rank_0-99_4.ckpt"})
    )
    with caplog.at_level(logging.WARNING):
        assert same(loaded_weights(str(rank_0)), newest_weights())
    assert "left out 1 checkpoint file name(s) that are links" in caplog.text
    assert "meta.json names a file that is not one of this folder's checkpoint files" in caplog.text


def test_a_rank_folder_that_is_a_link_is_refused(tmp_path):
    out = output_tree(tmp_path, ranks=1)
    shutil.move(out / "checkpoint" / "rank_0", tmp_path / "real_rank_0")
    os.symlink(tmp_path / "real_rank_0", out / "checkpoint" / "rank_0")
    with pytest.raises(WeightsError, match="without a rank_0 folder"):
        read_peer_checkpoint(str(out / "checkpoint"))


# -- the step, counted in this run's batches as a native run counts it ---------------------------------------------
@pytest.mark.parametrize("global_batch_size", [16, 32, 64])
def test_the_carried_step_and_samples_equal_a_native_runs_at_this_runs_batch_size(
    tmp_path, make_config, global_batch_size
):
    # MindSpore trained 2 epochs in 8 steps (4 an epoch); here 2 epochs of the recipe's 256 samples
    native = train(make_config(run_name="native", max_duration="2ep", global_batch_size=global_batch_size))
    out = output_tree(tmp_path)
    config = make_config(run_name="from-ms", load_path=str(out / "checkpoint"), max_duration="3ep",
                         global_batch_size=global_batch_size)  # fmt: skip
    session, _ = restore(config, CheckpointStore(config.save_folder, config.run_name))
    assert session.progress == native.progress
    assert session.progress.step == 512 // global_batch_size and session.progress.samples_seen == 512
    assert session.scheduler.last_epoch == session.progress.step  # the recipe's schedule at the carried step
    resumed = train(config)
    assert resumed.progress.step == 3 * 256 // global_batch_size  # where a native 3-epoch run ends


def _with_global_batch_size(data: bytes, value: int) -> bytes:
    """A MindSpore Transformers file: MindSpore's ``.ckpt`` with the ``global_batch_size`` its CheckpointMonitor
    appends (an Int64 scalar, laid out as MindSpore writes ``epoch_num``)."""
    tensor = b"\x08\x00" + b"\x12\x05Int64" + b"\x1a\x08" + value.to_bytes(8, "little")
    tag = b"global_batch_size"
    value_msg = b"\x0a" + bytes([len(tag)]) + tag + b"\x12" + bytes([len(tensor)]) + tensor
    return data + b"\x0a" + bytes([len(value_msg)]) + value_msg


def test_a_recorded_global_batch_size_gives_the_samples_and_is_not_a_weight(tmp_path):
    path = tmp_path / "llama_rank_0-2_4.ckpt"
    path.write_bytes(_with_global_batch_size(CKPT.read_bytes(), 64))
    peer = read_peer_checkpoint(str(path))
    assert sorted(peer.weights.state_dict) == sorted(NAMES)
    assert peer.progress == {"epoch": 2, "step": 8, "samples_seen": 512, "global_batch_size": 64}
    assert (
        "progress (epoch=2, step=8, samples_seen=512, global_batch_size=64, from epoch_num/global_step/"
        "global_batch_size)" in peer.taken
    )


# -- a full-state carry-over onto changed data: the hint names what works -------------------------------------------
def test_the_changed_data_refusal_names_ignore_data_skip_which_then_carries_the_state_over(make_config):
    a = make_config(run_name="a", max_duration="4ba", save_interval="4ba")  # half an epoch: sample 128 of 256
    train(a)
    smaller = {"num_samples": 64}
    b = make_config(run_name="b", load_path=f"{a.save_folder}/a", recipe_args=smaller, max_duration="2ep")
    with pytest.raises(ConfigError) as info:
        check_load_path(b)
    assert "sample_in_epoch=128 is past the end of an epoch of this run's data (64 samples)" in str(info.value)
    assert "set ignore_data_skip=true (its epoch starts at its first sample) or data_skip_steps=<n>" in str(info.value)
    b = b.model_copy(update={"ignore_data_skip": True})
    check_load_path(b)
    session, _ = restore(b, CheckpointStore(b.save_folder, "b"))
    assert session.progress == Progress(epoch=0, step=4, samples_seen=128, sample_in_epoch=0, global_batch_size=32)
    assert session.optimizer.state  # the optimizer's state came along, not weights only
    assert train(b).progress.epoch == 2


def test_an_object_store_copy_of_the_output_reads_the_same(tmp_path):
    import fsspec

    out = output_tree(tmp_path, {"last_epoch": 9, "last_step": 4, "last_ckpt_file": OLDER})
    fs = fsspec.filesystem("memory")
    for path in out.rglob("*"):
        if path.is_file():
            fs.pipe(f"/ms-{tmp_path.name}/{path.relative_to(tmp_path)}", path.read_bytes())
    try:
        uri = f"memory://ms-{tmp_path.name}/output/checkpoint"
        assert same(loaded_weights(uri), older_weights())  # meta.json's choice, read from the store
        assert same(loaded_weights(uri.replace("checkpoint", "checkpoint_network")), newest_weights())
    finally:
        fs.rm(f"/ms-{tmp_path.name}", recursive=True)


def test_a_deployment_runs_confined_read_takes_meta_json_and_never_a_link(tmp_path, caplog):
    from checkpointing.io import confine

    out = output_tree(tmp_path, {"last_epoch": 9, "last_step": 4, "last_ckpt_file": OLDER})
    with confine.confined([str(tmp_path)]):
        assert same(loaded_weights(str(out / "checkpoint")), older_weights())
        rank_1 = out / "checkpoint" / "rank_1"
        planted = tmp_path / "planted.json"
        planted.write_text((rank_1 / "meta.json").read_text())
        (rank_1 / "meta.json").unlink()
        os.symlink(planted, rank_1 / "meta.json")
        with caplog.at_level(logging.WARNING):
            assert same(loaded_weights(str(rank_1)), newest_weights())
    assert "meta.json is a link, not followed" in caplog.text


# -- a damaged newest file: one warning naming it, the next newest by {epoch}_{step} (MindSpore's own fallback) ------
def test_a_truncated_newest_file_is_skipped_with_one_warning_for_the_next_newest(tmp_path, make_config, caplog):
    out = output_tree(tmp_path, ranks=1)
    rank_0 = out / "checkpoint" / "rank_0"
    data = (rank_0 / NEWEST).read_bytes()
    (rank_0 / NEWEST).write_bytes(data[:-100])  # a writer killed mid-file; meta.json still names it
    (rank_0 / "tiny_rank_0-1_4.ckpt").write_bytes(CKPT.read_bytes())  # older still: never reached
    config = make_config(run_name="from-ms", load_path=str(out / "checkpoint"), max_duration="3ep")
    with caplog.at_level(logging.WARNING):
        check_load_path(config)  # the flow's start-up check: not refused
        session, origin = restore(config, CheckpointStore(config.save_folder, config.run_name))
    weights = {n: p.detach() for n, p in session.model.named_parameters()}
    assert same(weights, older_weights())  # the next newest file's weights, exactly
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and NEWEST in r.getMessage()]
    assert len(warnings) == 1 and f"the next newest by the {{epoch}}_{{step}} in its name: '{OLDER}'" in warnings[0]
    assert "the next newest file that reads ('tiny_rank_0-9_4.ckpt'; newer ones are damaged)" in origin.text


def test_when_no_file_reads_the_newest_files_error_is_raised(tmp_path):
    out = output_tree(tmp_path, ranks=1)
    for path in (out / "checkpoint" / "rank_0").glob("*.ckpt"):
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(WeightsError, match=rf"\({NEWEST}\).*and none of its 1 older file\(s\) read either"):
        read_peer_checkpoint(str(out / "checkpoint"))


# -- the same run relaunched on changed data (MindSpore's resume with the dataset changed, on its own output folder) --
def test_the_same_run_refused_on_changed_data_names_load_weights_only_and_both_data_skip_options(make_config):
    train(make_config(max_duration="4ba", save_interval="4ba"))  # half an epoch of 256: sample 128
    claims = CheckpointStore(make_config().save_folder, "r").fence.newest()
    with pytest.raises(ConfigError) as info:
        train(make_config(recipe_args={"num_samples": 64}, max_duration="2ep"))
    message = str(info.value)
    assert "recipe_args.num_samples: 256 -> 64" in message and "load_weights_only=true" in message
    assert "continue this run on it with ignore_data_skip=true (the current epoch restarts at the first " in message
    assert "or data_skip_steps=<n> (it resumes after n of its batches)" in message
    assert CheckpointStore(make_config().save_folder, "r").fence.newest() == claims  # refused before the claim


@pytest.mark.parametrize("option, sample_in_epoch", [({"ignore_data_skip": True}, 0), ({"data_skip_steps": 1}, 32)])
def test_the_same_run_relaunched_on_changed_data_with_a_data_skip_option_carries_its_state_over(
    make_config, caplog, option, sample_in_epoch
):
    first = train(make_config(max_duration="4ba", save_interval="4ba"))
    smaller = make_config(recipe_args={"num_samples": 64}, max_duration="2ep", **option)
    saved = CheckpointStore(smaller.save_folder, "r").load_latest(["state.pt"]).objects["state.pt"]["state"]
    with caplog.at_level(logging.WARNING):
        session, _ = restore(smaller, CheckpointStore(smaller.save_folder, "r"))
    assert session.progress == Progress(epoch=0, step=4, samples_seen=128, sample_in_epoch=sample_in_epoch,
                                        global_batch_size=32)  # fmt: skip
    for i, p in enumerate(session.optimizer.param_groups[0]["params"]):  # the optimizer's state came along
        assert torch.equal(
            session.optimizer.state[p]["momentum_buffer"], saved["optimizer"]["state"][i]["momentum_buffer"]
        )
    assert "run_name='r' continues on changed data (recipe_args.num_samples: 256 -> 64; checkpoint ep0-ba4-sa128)" in (
        caplog.text
    )
    done = train(smaller)
    assert first.progress.step == 4 and (done.progress.epoch, done.progress.samples_seen) == (
        2,
        128 + 128 - sample_in_epoch,
    )


def test_a_second_data_change_with_the_same_option_places_the_run_again(make_config):
    train(make_config(max_duration="4ba", save_interval="2ba"))  # sample 128 of 256
    train(make_config(recipe_args={"num_samples": 128}, ignore_data_skip=True, max_duration="6ba", save_interval="2ba"))
    store = CheckpointStore(make_config().save_folder, "r")
    assert store.latest().progress["sample_in_epoch"] == 64  # 2 batches into the 128 samples
    smaller = make_config(
        recipe_args={"num_samples": 64}, ignore_data_skip=True, max_duration="8ba", save_interval="2ba"
    )
    done = train(smaller)  # the same option, other data: applied again, not "already applied"
    assert (done.progress.epoch, done.progress.step, done.progress.samples_seen) == (1, 8, 256)


def test_a_data_skip_option_does_not_let_a_changed_model_continue_the_run(make_config):
    train(make_config(max_duration="4ba", save_interval="4ba"))
    claims = CheckpointStore(make_config().save_folder, "r").fence.newest()
    with pytest.raises(ConfigError, match=r"continued on changed data, does not fit the model this configuration "):
        train(make_config(recipe_args={"num_samples": 256, "hidden": 16}, ignore_data_skip=True, max_duration="1ep"))
    assert CheckpointStore(make_config().save_folder, "r").fence.newest() == claims
