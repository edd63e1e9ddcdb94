"""FSDP2 under real torchrun (gloo, CPU): sharded checkpoints reshard 2 -> 1 -> 2, and a corrupt shard on S3
(moto over HTTP) makes every rank fall back together.

Each torchrun follows a plan (tests/integration/fsdp_worker.py) and dumps whole states (model and optimizer,
gathered on rank 0) for the comparisons here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.__main__ import main as cli
from tests.conftest import MOTO_SECRET_KEY, ROOT

pytestmark = pytest.mark.slow


def torchrun(
    nproc: int,
    tmp_path: Path,
    tag: str,
    ops: list[dict],
    save_folder: str,
    options: dict | None = None,
    device: str = "cpu",
):
    """Runs the worker on ``nproc`` processes (gloo on CPU, nccl on CUDA); returns (one record per op, the
    processes' output)."""
    plan = tmp_path / f"{tag}.json"
    result = tmp_path / f"{tag}.jsonl"
    spec = {"save_folder": save_folder, "run_name": "r", "result": str(result), "ops": ops, "device": device}
    plan.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
    # The checkout first; a PYTHONPATH already set stays after it (packages carried outside site-packages, as on a
    # bare GPU machine: scripts/gpu_check.sh).
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    if options:
        env["TRAIN_STORAGE_OPTIONS"] = json.dumps(options)  # the endpoint travels by environment, not argv
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*cmd, "-m", "tests.integration.fsdp_worker", str(plan)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in result.read_text().splitlines()], proc.stdout + proc.stderr


def at(step: int) -> str:
    """The name the store gives the worker's checkpoint after ``step`` steps of 16 samples."""
    return f"ep0-ba{step}-sa{16 * step}"


def whole(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    """Model weights, optimizer moments and step counters bit for bit; hyper-parameters equal."""
    assert a["model"].keys() == b["model"].keys() and a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k, moments in a["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, b["optimizer"]["state"][k][name]), (k, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def test_fsdp_checkpoints_reshard_2_to_1_to_2_exactly_and_training_goes_on(tmp_path):
    runs = str(tmp_path / "runs")
    d = {n: tmp_path / f"{n}.pt" for n in ("saved3", "loaded3", "saved5", "loaded5", "saved6", "resumed6", "ref6")}
    first, _ = torchrun(  # 2 ranks: 3 steps, save; 3 more steps uninterrupted: the reference
        2,
        tmp_path,
        "a",
        [
            {"op": "train", "steps": 3},
            {"op": "save", "name": at(3)},
            {"op": "dump", "file": str(d["saved3"])},
            {"op": "train", "steps": 3},
            {"op": "dump", "file": str(d["ref6"])},
        ],
        runs,
    )
    one, _ = torchrun(  # 1 rank: load the 2-rank checkpoint, 2 steps, save
        1,
        tmp_path,
        "b",
        [
            {"op": "load", "name": at(3)},
            {"op": "dump", "file": str(d["loaded3"])},
            {"op": "train", "steps": 2},
            {"op": "save", "name": at(5)},
            {"op": "dump", "file": str(d["saved5"])},
        ],
        runs,
    )
    two, _ = torchrun(  # 2 ranks: load the 1-rank checkpoint, 1 step, save; then resume s3 at the same world size
        2,
        tmp_path,
        "c",
        [
            {"op": "load", "name": at(5)},
            {"op": "dump", "file": str(d["loaded5"])},
            {"op": "train", "steps": 1},
            {"op": "save", "name": at(6)},
            {"op": "dump", "file": str(d["saved6"])},
            {"op": "load", "name": at(3)},
            {"op": "train", "steps": 3},
            {"op": "dump", "file": str(d["resumed6"])},
        ],
        runs,
    )
    # Every reshard loads exactly what was saved: model, Adam moments, step counters, hyper-parameters.
    assert_same_state(whole(d["loaded3"]), whole(d["saved3"]))  # 2 -> 1
    assert_same_state(whole(d["loaded5"]), whole(d["saved5"]))  # 1 -> 2
    # Resuming at the same world size is the same math: bit-identical to the uninterrupted run.
    assert_same_state(whole(d["resumed6"]), whole(d["ref6"]))
    # Through one rank, each step's gradient is one mean over 16 rows instead of the mean of two 8-row means:
    # float32 rounds differently (seen: <= 1.5e-8, one ulp of the largest weights). A wrong shard order or a
    # lost optimizer state would be off by ~1e-3.
    ref, via_one = whole(d["ref6"]), whole(d["saved6"])
    for k in ref["model"]:
        torch.testing.assert_close(via_one["model"][k], ref["model"][k], rtol=0, atol=1e-6)
    assert whole(d["saved6"])["step"] == 6

    # What each rank got back besides the tensors: progress, and its own RNG record only if it existed.
    assert [r["rank_extra"] for r in one[0]["ranks"]] == [{"rank": 0}]
    assert [r["rank_extra"] for r in two[0]["ranks"]] == [{"rank": 0}, None]
    assert all(r["step"] == 5 for r in two[0]["ranks"])
    # Reads: at the same world size no rank reads the other's big shard file.
    same_world = two[5]["ranks"]
    assert "__1_0.distcp" not in same_world[0]["files_read"] and "__0_0.distcp" not in same_world[1]["files_read"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(one[0]["ranks"][0]["files_read"])  # 2 -> 1 needs both

    store = CheckpointStore(runs, "r")
    info = store.latest()
    assert info.name == at(6) and info.manifest.metadata["world_size"] == 2
    assert set(info.manifest.files) == set(first[1]["ranks"][0]["files"])
    assert set(info.manifest.files) == set(os.listdir(tmp_path / "runs/r/checkpoints" / at(6))) - {"manifest.json"}
    assert cli(["verify", store.uri]) == 0
    out = str(tmp_path / "export.pt")
    assert cli(["export", store.uri, out]) == 0
    exported = torch.load(out, weights_only=True)["model"]
    assert exported.keys() == via_one["model"].keys()
    assert all(torch.equal(exported[k], via_one["model"][k]) for k in exported)


def test_a_flipped_byte_in_one_ranks_shard_on_s3_makes_every_rank_fall_back(s3, tmp_path):
    folder, options = s3
    good = tmp_path / "good.pt"
    _, output = torchrun(
        2,
        tmp_path,
        "save",
        [
            {"op": "train", "steps": 2},
            {"op": "save", "name": at(2)},
            {"op": "dump", "file": str(good)},
            {"op": "train", "steps": 2},
            {"op": "save", "name": at(4)},
        ],
        folder,
        options,
    )
    store = CheckpointStore(folder, "r", storage_options=options)
    assert store.latest().name == at(4) and store.check(at(4), deep=True) == []
    assert cli(["verify", store.uri, "--storage-options", json.dumps(options)]) == 0

    data = bytearray(store.storage.get(f"checkpoints/{at(4)}/__1_0.distcp"))
    data[len(data) // 2] ^= 0x10  # one flipped bit, same size
    store.storage.put(f"checkpoints/{at(4)}/__1_0.distcp", bytes(data))
    assert store.check(at(4)) == [] and store.check(at(4), deep=True) == [f"{at(4)}/__1_0.distcp: sha256 mismatch"]
    assert cli(["verify", store.uri, "--storage-options", json.dumps(options)]) == 1

    records, output2 = torchrun(
        2,
        tmp_path,
        "load",
        [
            {"op": "load", "name": at(4)},
            {"op": "restore_latest"},
            {"op": "dump", "file": str(tmp_path / "restored.pt")},
        ],
        folder,
        options,
    )
    direct, fallback = records[0]["ranks"], records[1]["ranks"]
    # Only rank 1 reads __1_0.distcp, yet both ranks raise: neither trains on a half-loaded state.
    assert [r["error"] for r in direct] == ["CorruptCheckpointError"] * 2
    assert all(
        f"{at(4)}/__1_0.distcp" in r["message"] and "does not match the manifest" in r["message"] for r in direct
    )
    assert [(r["name"], r["step"]) for r in fallback] == [(at(2), 2), (at(2), 2)]
    assert f"skipping checkpoint {at(4)}" in output2
    assert_same_state(whole(tmp_path / "restored.pt"), whole(good))
    assert MOTO_SECRET_KEY not in output + output2
