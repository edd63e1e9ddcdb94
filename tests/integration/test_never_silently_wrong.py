"""Damage, drift and repeated launches are noticed, named, and never turned into a quietly wrong model.

Each test reproduces a report of the "never silently wrong" issues with real files, through the run's lifecycle
(``train_run``: training.run.Run, as the train flow drives it): a flipped bit in a manifest, a same-size corruption
of the final checkpoint, a relaunch with another model, data-skip options at every restart, a max_duration below
what was trained; and through the real flow (Prefect test server), where its retries and its flow-run labels are
part of the report: a commit that does not land, a fenced writer told who displaced it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore, CorruptCheckpointError, Writer
from checkpointing.manifest import Manifest
from flows.train import train
from tests.conftest import RECORDING
from tests.faults import FaultProxy
from training.config import ConfigError
from training.position.progress import Progress
from training.position.sampler import epoch_order
from training.run import MAX_REPEATS, RepeatGuard
from training.unit.loop import UnitResult


def weights(config, name: str | None = None) -> dict[str, torch.Tensor]:
    store = CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options)
    info = store.info(name) if name else store.latest(deep=True)
    return store.load(info, files=["state.pt"]).objects["state.pt"]["state"]["model"]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flip_byte(path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_flipped_bit_in_a_manifests_progress_falls_back_instead_of_resuming_from_the_wrong_sample(
    make_config, caplog, train_run
):
    clean = train_run(make_config(run_name="clean"))
    config = make_config(run_name="flipped", max_duration="2ep")
    first = train_run(config)
    path = Path(config.save_folder, "flipped", "checkpoints", first.checkpoint_name, "manifest.json")
    text = path.read_text()
    offset = text.index('"samples_seen": 512') + len('"samples_seen": 51')  # '2' (0x32) -> '3' (0x33)
    flip_byte(path, offset)
    assert '"samples_seen": 513' in path.read_text()

    with caplog.at_level(logging.WARNING):
        result = train_run(make_config(run_name="flipped", max_duration="3ep"))

    assert "does not match its own checksum" in caplog.text
    assert result.units[0].resumed_from == "checkpoint ep1-ba8-sa256"  # fell back past the damaged one
    assert (result.epoch, result.samples_seen) == (3, 768)
    assert_same(weights(make_config(run_name="clean")), weights(make_config(run_name="flipped")))
    assert clean.metrics == result.metrics


def test_a_manifest_whose_progress_disagrees_with_the_state_file_is_not_trusted(make_config, train_run):
    config = make_config(max_duration="2ep")
    train_run(config)
    store = CheckpointStore(config.save_folder, "r")
    newest = store.latest()
    forged = Manifest(name=newest.name, files=newest.manifest.files, metadata=newest.manifest.metadata,
                      progress={**newest.progress, "sample_in_epoch": 96}, writer=newest.manifest.writer)  # fmt: skip
    store.storage.put(f"checkpoints/{newest.name}/manifest.json", forged.to_json())  # self-consistent, but wrong

    with pytest.raises(CorruptCheckpointError, match=r"disagrees with the copy inside state\.pt"):
        store.load(newest.name)
    assert store.load_latest().info.name == "ep1-ba8-sa256"


@pytest.mark.parametrize("damage", ["same-size corruption of state.pt", "flipped byte in rng-rank0.pt"])
def test_a_relaunch_of_a_complete_run_verifies_what_it_returns_and_retrains_what_was_lost(
    make_config, damage, caplog, train_run
):
    config = make_config()
    done = train_run(config)
    reference = weights(config)
    store = CheckpointStore(config.save_folder, "r")
    folder = Path(config.save_folder, "r", "checkpoints", done.checkpoint_name)
    flip_byte(folder / ("state.pt" if "state" in damage else "rng-rank0.pt"))

    with caplog.at_level(logging.WARNING):
        again = train_run(config)

    assert f"the final checkpoint {done.checkpoint_name} failed verification" in caplog.text
    assert [u.unit for u in again.units] == [2] and again.units[0].resumed_from == "checkpoint ep2-ba16-sa512"
    assert store.check(store.info(again.units[0].checkpoint_name), deep=True) == []  # what it returns verifies
    assert_same(reference, weights(config, again.units[0].checkpoint_name))  # and it is the same model
    assert again.metrics == done.metrics


def test_relaunching_with_another_model_is_one_clear_error_before_anything_runs(make_config, tmp_path, train_run):
    train_run(make_config(max_duration="1ep", recipe_args={"num_samples": 256, "hidden": 8}))
    store = CheckpointStore(make_config().save_folder, "r")
    claims_before = store.fence.newest()

    with pytest.raises(ConfigError) as info:
        train_run(make_config(max_duration="2ep", recipe_args={"num_samples": 256, "hidden": 16}))

    message = str(info.value)
    assert message.startswith("run_name='r' was trained with another configuration than this launch")
    assert "recipe_args.hidden: 8 -> 16" in message
    assert "choose a new run_name" in message and "load_weights_only=true" in message
    assert store.fence.newest() == claims_before  # refused before claiming the run: nothing written
    # Legitimate changes are allowed: batch size, duration, retention.
    again = train_run(make_config(max_duration="2ep", global_batch_size=64, num_checkpoints_to_keep=5,
                              recipe_args={"num_samples": 256, "hidden": 8}))  # fmt: skip
    assert again.epoch == 2


def test_data_skip_options_are_applied_once_per_run_not_at_every_restart(make_config, tmp_path, train_run):
    record = tmp_path / "ids"
    args = {"num_samples": 240, "record_dir": str(record)}

    def launch(duration: str):
        train_run(make_config(recipe=RECORDING, recipe_args=args, max_duration=duration, save_interval="2ba",
                          ignore_data_skip=True))  # fmt: skip
        ids = [int(i) for line in (record / "ids-rank0.txt").read_text().split("\n") for i in line.split()]
        (record / "ids-rank0.txt").unlink()
        return ids

    train_run(make_config(recipe=RECORDING, recipe_args=args, max_duration="5ba", save_interval="5ba"))  # to sample 160
    (record / "ids-rank0.txt").unlink()
    order = epoch_order(240, 7, 0).tolist()

    assert launch("7ba") == order[:64]  # applied: the epoch restarts, 2 batches
    assert launch("9ba") == order[64:128]  # the same options again (a restart): not applied again
    assert launch("11ba") == order[128:192]


def test_a_max_duration_below_what_was_trained_says_so_and_names_the_checkpoint_that_matches(
    make_config, capsys, train_run
):
    train_run(make_config())  # 3 epochs
    result = train_run(make_config(max_duration="2ep"))

    assert result.units == [] and result.epoch == 3  # nothing trained, nothing thrown away
    assert len(result.warnings) == 1
    assert result.warnings[0].startswith("run 'r' already trained past max_duration=2ep (its newest checkpoint "
                                         "ep3-ba24-sa768 is at epoch 3")  # fmt: skip
    assert "The checkpoint at 2ep is ep2-ba16-sa512; to go back to it: resume_from=ep2-ba16-sa512" in result.warnings[0]


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")
def test_a_commit_that_does_not_land_fails_the_unit_loudly_and_latest_stays(s3, moto_server, make_config):
    folder, _ = s3
    with FaultProxy(moto_server) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.endpoint}}
        config = make_config(save_folder=folder, storage_options=options, max_duration="2ep", unit_retries=1)
        train(make_config(save_folder=folder, storage_options=options, max_duration="1ep"))
        # Every later upload of a state file is answered 200 but never stored: the commit cannot verify.
        proxy.script(r"PUT .*/checkpoints/ep2-[^/]*/state\.pt", *[(200, "application/xml", b"")] * 10)

        with pytest.raises(CorruptCheckpointError, match=r"checkpoint ep2-ba16-sa512 did not verify right after it "
                                                         r"was written \(ep2-ba16-sa512/state\.pt: missing\)"):  # fmt: skip
            train(config)

        assert len(proxy.seen(r"PUT .*/checkpoints/ep2-[^/]*/state\.pt")) == 2  # the attempt and its one retry
        store = CheckpointStore(folder, "r", storage_options=options)
        assert store.read_pointer()["name"] == "ep1-ba8-sa256"


def _result(unit: int, samples: int, steps: int = 8) -> UnitResult:
    return UnitResult(unit=unit, checkpoint=f"runs/r/checkpoints/u{unit}", checkpoint_name=f"u{unit}",
                      checkpoint_committed=True, progress={"samples_seen": samples}, complete=False,
                      origin="store", resumed_from="x", steps=steps, metrics={}, num_train_samples=256)  # fmt: skip


def test_a_flow_whose_units_keep_ending_at_the_same_place_stops_instead_of_retraining_forever():
    guard = RepeatGuard(Progress(samples_seen=0))
    guard.check(_result(0, 256))
    guard.check(_result(1, 512))
    for _ in range(MAX_REPEATS):
        guard.check(_result(1, 512))  # the commit vanished: the same unit again
    with pytest.raises(RuntimeError, match=re.escape("unit 1 ended at 512 samples, where earlier units of this run")):
        guard.check(_result(1, 512))
    with pytest.raises(RuntimeError, match="trained no step"):
        RepeatGuard(Progress()).check(_result(0, 0, steps=0))


@pytest.mark.slow  # a Prefect test server (and the train flow's task runs): not in the fast tier
@pytest.mark.usefixtures("prefect_harness")  # the claim is labelled by the flow run that made it
def test_a_fenced_writer_is_told_who_displaced_it(make_config, caplog):
    config = make_config(max_duration="1ep")
    train(config)
    store = CheckpointStore(config.save_folder, "r")
    old = Writer.current(store.fence.newest())
    with caplog.at_level(logging.INFO):
        newer = store.claim_generation(label="flow run B")
    assert f"claimed writer generation {newer}; the previous writer was generation {old.generation} (flow run" in (
        caplog.text
    )
    with pytest.raises(Exception, match=rf"a newer writer, generation {newer} \(flow run B, host .*, pid \d+, \d+ s "
                                        r"ago\), has claimed this run; this writer \(generation"):  # fmt: skip
        store.save("x", {"state.pt": {"x": torch.ones(1)}}, progress={"samples_seen": 1}, writer=old)
    assert json.loads(store.storage.get("latest"))["name"] == "ep1-ba8-sa256"
