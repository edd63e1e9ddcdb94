"""A deployment run's files stay under the worker's allowed roots at the moment of use, even through links planted in
an allowed folder before the run or swapped in while it trains (training/config/trust.py, checkpointing/io/confine.py).

Each test opens the run as a deployment run does (``Run.open(untrusted=True)`` with ``TRAIN_ALLOWED_ROOTS`` set),
plants real links with ``os.symlink``, and checks the one line the run fails with and that nothing was written or
trained outside the root."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from checkpointing import CheckpointStore
from checkpointing.io import confine
from checkpointing.io.localfs import LinkedLocationError
from recipes.synthetic import SyntheticRecipe
from training.config import ConfigError
from training.run import Run, execute_unit
from training.start.warm_start import check_load_path
from training.unit.loop import run_unit

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
LINK_LINE = "a symbolic link below the allowed root (TRAIN_ALLOWED_ROOTS); a deployment run never reads or writes"


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """An allowed root (the worker's TRAIN_ALLOWED_ROOTS) and, beside it, another team's folder (outside it)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "other-team"
    allowed.mkdir()
    outside.mkdir()
    monkeypatch.setenv("TRAIN_ALLOWED_ROOTS", str(allowed))
    yield allowed, outside
    leaked = confine.local_roots()
    while confine.local_roots() is not None:  # leave no other test confined, whatever this one did
        confine.leave()
    assert leaked is None, "a run left this process confined"


@pytest.fixture
def deployment_config(make_config, roots):
    allowed, _ = roots
    return lambda **overrides: make_config(save_folder=str(allowed / "runs"), **overrides)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 500, text
    return text


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def their_weights(outside: Path) -> Path:
    """Another team's weights, outside the root, of the shape the run's recipe builds (so that they would load)."""
    torch.manual_seed(5)
    path = outside / "their-weights.safetensors"
    safetensors.torch.save_file(SyntheticRecipe().build_model().state_dict(), path)
    return path


def plant_hugging_face_folder(allowed: Path, outside: Path) -> Path:
    """An allowed save_pretrained folder whose model.safetensors is a link to another team's weights."""
    folder = allowed / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "synthetic"}')
    os.symlink(their_weights(outside), folder / "model.safetensors")
    return folder


# -- load_path: links inside an allowed folder ---------------------------------------------------------------
def test_a_link_in_an_allowed_hugging_face_folder_is_refused_in_one_line_and_nothing_is_trained(
    deployment_config, roots
):
    allowed, outside = roots
    config = deployment_config(load_path=str(plant_hugging_face_folder(allowed, outside)), load_weights_only=True)
    with pytest.raises(LinkedLocationError) as info:
        Run.open(config, untrusted=True)
    assert one_line(info.value).startswith(f"load_path={config.load_path!r} (model.safetensors): {LINK_LINE}")
    assert CheckpointStore(config.save_folder, config.run_name).latest() is None
    assert not (allowed / "runs").exists()  # nothing claimed, nothing written


def test_a_link_swapped_into_the_folder_after_the_start_is_refused_when_the_unit_reads_it(deployment_config, roots):
    allowed, outside = roots
    folder = plant_hugging_face_folder(allowed, outside)
    (folder / "model.safetensors").unlink()
    shutil.copy(outside / "their-weights.safetensors", folder / "model.safetensors")  # a real file when checked
    config = deployment_config(load_path=str(folder), load_weights_only=True)
    with Run.open(config, untrusted=True) as run:
        (folder / "model.safetensors").unlink()
        os.symlink(outside / "their-weights.safetensors", folder / "model.safetensors")
        with pytest.raises(LinkedLocationError, match=re.escape(LINK_LINE)):
            run_unit(config, start_checkpoint=run.head, generation=run.generation)
        assert run.store.list() == []  # nothing trained on their weights


@pytest.mark.parametrize("through", ["the .symlink pointer", "the file itself"])
def test_a_composer_checkpoint_that_is_a_link_is_refused_directly_or_through_its_symlink_pointer(
    deployment_config, roots, through
):
    allowed, outside = roots
    shutil.copy(PEERS / "composer" / "ep2.pt", outside / "ep2.pt")
    folder = allowed / "composer" / "checkpoints"
    folder.mkdir(parents=True)
    os.symlink(outside / "ep2.pt", folder / "ep2.pt")
    (folder / "latest-rank0.pt.symlink").write_text("composer/checkpoints/ep2.pt")
    pointer = through == "the .symlink pointer"
    load_path = str(folder / ("latest-rank0.pt.symlink" if pointer else "ep2.pt"))
    config = deployment_config(load_path=load_path, load_weights_only=True)
    check_load_path(config)  # python -m flows.train and train() follow it: the person's own choice
    error = LinkedLocationError if pointer else ConfigError  # the file itself: refused by the check of locations
    with pytest.raises(error) as info:
        Run.open(config, untrusted=True)
    where = f"load_path={load_path!r} (the file it names)" if pointer else f"load_path={load_path!r}"
    assert one_line(info.value).startswith(f"{where}: {LINK_LINE}")
    assert not (allowed / "runs").exists()


# -- save_folder and export_on_complete replaced by links while the run trains -------------------------------
def test_a_save_folder_replaced_by_a_link_between_units_fails_the_next_unit_and_writes_nothing_outside(
    deployment_config, roots
):
    allowed, outside = roots
    config = deployment_config()
    with Run.open(config, untrusted=True) as run:
        run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
        os.rename(allowed / "runs", allowed / "runs-moved")
        os.symlink(outside, allowed / "runs")
        with pytest.raises(LinkedLocationError) as info:
            run_unit(config, start_checkpoint=run.head, generation=run.generation)
    assert one_line(info.value).startswith(f"{allowed / 'runs'} is a symbolic link below the allowed root")
    assert files_under(outside) == []
    assert [i.name for i in CheckpointStore(str(allowed / "runs-moved"), "r").list()] == [run.units[0].checkpoint_name]


@pytest.mark.slow
def test_the_rank_processes_of_a_deployment_run_are_confined_too(deployment_config, roots):
    """A gang's ranks are kept across units and write the checkpoint files themselves: they inherit the roots."""
    allowed, outside = roots
    config = deployment_config(nproc_per_node=2, max_duration="2ep", recipe_args={"num_samples": 128})
    with Run.open(config, untrusted=True) as run:
        run.record(execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation))
        os.rename(allowed / "runs", allowed / "runs-moved")
        os.symlink(outside, allowed / "runs")
        with pytest.raises(LinkedLocationError) as info:
            execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation)
    assert one_line(info.value).startswith(f"{allowed / 'runs'} is a symbolic link below the allowed root")
    assert files_under(outside) == []


def test_an_export_folder_replaced_by_a_link_before_the_export_fails_the_run_and_writes_nothing_outside(
    deployment_config, roots
):
    allowed, outside = roots
    (allowed / "exports").mkdir()
    config = deployment_config(max_duration="1ep", export_on_complete=str(allowed / "exports" / "model.pt"))
    with Run.open(config, untrusted=True) as run:
        run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
        os.rename(allowed / "exports", allowed / "exports-moved")
        os.symlink(outside, allowed / "exports")
        with pytest.raises(LinkedLocationError) as info:
            run.finish({})
    assert one_line(info.value).startswith(f"export_on_complete={config.export_on_complete!r}: {LINK_LINE}")
    assert files_under(outside) == [] and files_under(allowed / "exports-moved") == []


def test_a_deployment_run_without_links_trains_and_exports_under_its_root(deployment_config, roots):
    allowed, outside = roots
    export = allowed / "exports" / "model.safetensors"
    config = deployment_config(max_duration="2ep", export_on_complete=str(export))
    with Run.open(config, untrusted=True) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
        result = run.finish({})
    assert result.step == 16 and len(CheckpointStore(config.save_folder, "r").list()) == 2
    weights = safetensors.torch.load_file(export)
    assert all(isinstance(v, torch.Tensor) for v in weights.values()) and weights
    assert files_under(outside) == []


def test_a_sharded_save_makes_its_folder_through_no_link_when_the_save_folder_turns_into_one(roots):
    """DCP makes a checkpoint's folder itself (fsspec's makedirs follows links): a save folder swapped for a link
    after the checkpoint was begun gets no folder outside the root."""
    from checkpointing import Writer
    from checkpointing.commit import sharded

    allowed, outside = roots
    with confine.confined([str(allowed)]):
        store = CheckpointStore(str(allowed / "runs"), "r")
        info = sharded.save_state(
            store, "s1", {"w": torch.ones(4)}, progress={"samples_seen": 1}, writer=Writer.current(1)
        )
        assert info.name == "s1" and store.latest().name == "s1"  # DCP's mkdir and rename go through LocalFiles
        folder = sharded._HashingFileSystem(store, "s2")
        os.rename(allowed / "runs", allowed / "runs-moved")
        os.symlink(outside, allowed / "runs")
        with pytest.raises(LinkedLocationError, match="is a symbolic link below the allowed root"):
            folder.mkdir(store.storage.path("checkpoints/s2"))
    assert files_under(outside) == []
