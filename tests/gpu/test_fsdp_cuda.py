"""FSDP2 on CUDA/nccl: a sharded checkpoint written from the GPU loads on 2 CPU/gloo processes, exactly.

Runs where a GPU is present (one is enough: nccl takes one process per GPU, the load runs on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_fsdp import assert_same_state, at, torchrun, whole

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_sharded_checkpoint_saved_on_cuda_reshards_onto_two_cpu_processes(tmp_path):
    runs = str(tmp_path / "runs")
    saved, loaded = tmp_path / "saved.pt", tmp_path / "loaded.pt"
    name = at(3)  # the store names the checkpoint from its progress; the worker checks that it made this one
    records, _ = torchrun(
        1,
        tmp_path,
        "cuda",
        [{"op": "train", "steps": 3}, {"op": "save", "name": name}, {"op": "dump", "file": str(saved)}],
        runs,
        device="cuda",
    )
    assert records[1]["ranks"][0]["name"] == name
    cpu, _ = torchrun(2, tmp_path, "cpu", [{"op": "load", "name": name}, {"op": "dump", "file": str(loaded)}], runs)
    assert [(r["name"], r["step"]) for r in cpu[0]["ranks"]] == [(name, 3), (name, 3)]
    assert_same_state(whole(loaded), whole(saved))
