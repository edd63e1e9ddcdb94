"""Torn folders of dead writers (checkpointing/torn.py): a real process SIGKILLed during a roll-back the moment its
first retrained checkpoint folder exists, then the same command: the run ends with the weights of an uninterrupted
roll-back, the torn folder is gone, and ``python -m checkpointing verify`` passes; a leftover a writer could not clean
is reported as one (exit 0), while damage to a committed checkpoint still fails verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.__main__ import main as checkpoint_cli
from checkpointing.fencing import Fence
from tests.conftest import ROOT

ARGS = {"recipe": "recipes.synthetic:SyntheticRecipe", "recipe_args": {"num_samples": 96}, "global_batch_size": 16,
        "max_duration": "6ba", "save_interval": "1ba", "seed": 7}  # fmt: skip
BACK_TO, TORN = "ep0-ba2-sa32", "ep0-ba3-sa48-g2"  # the roll-back's target; its first retrained folder (generation 2)


def flags(folder: Path, **extra: str) -> list[str]:
    values = {**ARGS, "run_name": "r", "save_folder": str(folder), **extra}
    return [a for k, v in values.items() for a in (f"--{k}", json.dumps(v) if isinstance(v, dict) else str(v))]


def relaunch(folder: Path, log: Path, kill_at: Path | None = None) -> int:
    """The roll-back's command in a process of its own; with ``kill_at``, SIGKILLed the moment that folder exists."""
    module = ["tests.kill_at_folder", str(kill_at)] if kill_at else ["tests.run_lifecycle"]
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", *module, *flags(folder, resume_from=BACK_TO)], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT, timeout=300)  # fmt: skip
    return done.returncode


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    loaded = CheckpointStore(str(folder), "r").load_latest(["state.pt"])
    assert loaded is not None
    return loaded.objects["state.pt"]["state"]["model"]


def verify(run: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = checkpoint_cli(["verify", str(run)])
    return code, capsys.readouterr().out


@pytest.mark.slow  # two Python processes (one SIGKILLed), two in-process runs: ~20 s here
def test_a_writer_killed_mid_roll_back_leaves_a_folder_the_next_writer_removes(
    tmp_path, make_config, train_run, capsys
):
    reference = make_config(save_folder=str(tmp_path / "reference"), **ARGS)
    train_run(reference)
    train_run(reference.model_copy(update={"resume_from": BACK_TO}))  # the uninterrupted roll-back
    runs = tmp_path / "runs"
    train_run(make_config(save_folder=str(runs), **ARGS))  # generation 1: ep0-ba1 ... ep0-ba6
    run, torn = runs / "r", runs / "r" / "checkpoints" / TORN

    assert relaunch(runs, tmp_path / "killed.log", kill_at=torn) == -9  # generation 2, killed by its own SIGKILL
    assert torn.is_dir() and not (torn / "manifest.json").exists(), sorted(p.name for p in run.rglob("*"))
    code, out = verify(run, capsys)  # generation 2 holds the newest claim: its folder may still be in flight
    assert code == 1 and f"{TORN}: BAD: {TORN}: no readable manifest.json" in out

    Fence(CheckpointStore(str(runs), "r").storage).claim(floor=0)  # a writer that died right after its claim
    code, out = verify(run, capsys)
    assert code == 0, out
    assert f"{TORN}: leftover of writer generation 2, which stopped before committing it (no manifest.json; " in out
    assert f"the next writer of this run removes it, or delete the folder {torn}" in out

    assert relaunch(runs, tmp_path / "relaunched.log") == 0, (tmp_path / "relaunched.log").read_text()[-3000:]
    assert not torn.exists()  # removed by the writer after it claimed generation 4
    assert (
        f"removed 1 folder(s) that writers before generation 4 began and never committed (no manifest.json): {TORN}"
        in (tmp_path / "relaunched.log").read_text()
    )
    mine, theirs = final_weights(runs), final_weights(tmp_path / "reference")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    code, out = verify(run, capsys)
    assert code == 0 and "BAD" not in out and "leftover" not in out, out


def test_damage_to_a_committed_checkpoint_still_fails_verify(make_config, train_run, capsys):
    config = make_config(**{**ARGS, "max_duration": "3ba"})
    train_run(config)
    run = Path(config.save_folder) / "r"
    Fence(CheckpointStore(config.save_folder, "r").storage).claim(floor=0)  # generation 2: any -g1 would be old
    state = run / "checkpoints" / "ep0-ba2-sa32" / "state.pt"
    original = state.read_bytes()
    data = bytearray(original)
    data[-20] ^= 1
    state.write_bytes(bytes(data))  # a committed checkpoint's file, one bit changed
    code, out = verify(run, capsys)
    assert code == 1 and "ep0-ba2-sa32: BAD: ep0-ba2-sa32/state.pt: sha256 mismatch" in out

    state.write_bytes(original[:-20])  # its manifest is there: a file cut short is damage, never a leftover
    (run / "checkpoints" / "ep0-ba1-sa16-g1").mkdir()  # beside it, a dead generation-1 writer's folder: a leftover
    (run / "checkpoints" / "ep0-ba1-sa16-g1" / "state.pt").write_bytes(b"torn")
    code, out = verify(run, capsys)
    assert code == 1 and "ep0-ba2-sa32: BAD: ep0-ba2-sa32/state.pt: size" in out
    assert "ep0-ba1-sa16-g1: leftover of writer generation 1" in out

    state.write_bytes(original)
    code, out = verify(run, capsys)
    assert code == 0 and "ep0-ba1-sa16-g1: leftover of writer generation 1" in out
    (run / "checkpoints" / "ep0-ba3-sa48" / "manifest.json").unlink()  # of the checkpoint latest names: damage
    code, out = verify(run, capsys)
    assert code == 1 and "ep0-ba3-sa48: BAD: ep0-ba3-sa48: no readable manifest.json" in out


def test_a_claim_removes_only_folders_without_a_manifest_that_nobody_is_writing(make_config, train_run):
    config = make_config(**{**ARGS, "max_duration": "3ba"})
    train_run(config)
    store = CheckpointStore(config.save_folder, "r")
    folders = Path(config.save_folder) / "r" / "checkpoints"
    for name in ("ep0-ba4-sa64", "ep0-ba2-sa32-g1", "ep0-ba5-sa80"):  # torn: with and without a generation
        (folders / name).mkdir()
        (folders / name / "state.pt").write_bytes(b"torn")
    (folders / "ep0-ba1-sa16" / "manifest.json").write_text("{not json")  # damage to a committed checkpoint: kept
    from checkpointing import store as store_module

    store_module._WRITING.add((store.uri, "ep0-ba5-sa80"))  # this process is writing it (a snapshot upload, say)
    try:
        generation = store.claim_generation(label="next writer")
    finally:
        store_module._WRITING.discard((store.uri, "ep0-ba5-sa80"))
    assert generation == 2
    assert sorted(p.name for p in folders.iterdir()) == ["ep0-ba1-sa16", "ep0-ba2-sa32", "ep0-ba3-sa48", "ep0-ba5-sa80"]
    assert [i.name for i in store.candidates()] == ["ep0-ba3-sa48", "ep0-ba2-sa32"]


def test_on_every_store_verify_tells_a_leftover_and_the_next_claim_removes_torn_folders(backend, capsys):
    from checkpointing.manifest import Writer

    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    writer = Writer.current(store.claim_generation(label="first"), "first")
    for step in (1, 2):
        progress = {"epoch": 0, "step": step, "samples_seen": 16 * step}
        store.save(f"ep0-ba{step}-sa{16 * step}", {"state.pt": {"step": step}}, progress=progress, writer=writer)
    for torn in ("ep0-ba3-sa48-g1", "ep0-ba3-sa48"):  # objects of a commit cut short: no manifest (S3: no folder)
        store.storage.put(f"checkpoints/{torn}/state.pt", b"torn")
    Fence(store.storage).claim(floor=0)  # generation 2, which died before it cleaned
    capsys.readouterr()
    code = checkpoint_cli(["verify", store.uri, "--storage-options", json.dumps(options or {})])
    out = capsys.readouterr().out
    assert "ep0-ba3-sa48-g1: leftover of writer generation 1" in out and "ep0-ba1-sa16: ok" in out
    assert code == 1 and "ep0-ba3-sa48: BAD: ep0-ba3-sa48: no readable manifest.json" in out  # generation unknown

    assert store.claim_generation(label="next") == 3
    assert store.folders() == ["ep0-ba1-sa16", "ep0-ba2-sa32"]
    assert checkpoint_cli(["verify", store.uri, "--storage-options", json.dumps(options or {})]) == 0
