"""Sharded (DCP) checkpoints in one process, on a local folder, memory:// and S3 over HTTP (moto).

The multi-process side (FSDP2 under torchrun, resharding) is in tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import fsspec
import pytest
import torch

from checkpointing import (
    CheckpointStore,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    Writer,
)
from checkpointing.__main__ import main as cli
from checkpointing.commit import sharded
from checkpointing.manifest import Manifest
from checkpointing.store import FencedError


def state(seed: float) -> dict:
    """What FSDP saves, in miniature: big and small tensors, a step counter, plain hyper-parameters."""
    g = torch.Generator().manual_seed(int(seed))
    return {
        "model": {"big.weight": torch.randn(512, 256, generator=g), "big.bias": torch.full((3,), seed)},
        "optimizer": {
            "state": {"big.weight": {"step": torch.tensor(seed)}},
            "param_groups": [{"lr": 0.01 * seed, "betas": (0.9, 0.999), "params": ["big.weight", "big.bias"]}],
        },
    }


def blank() -> dict:
    """A state of the same shapes, to load into."""
    return {
        "model": {"big.weight": torch.zeros(512, 256), "big.bias": torch.zeros(3)},
        "optimizer": {
            "state": {"big.weight": {"step": torch.tensor(0.0)}},
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["", ""]}],
        },
    }


def two_sharded(backend) -> CheckpointStore:
    folder, options = backend
    store = CheckpointStore(folder, "r", storage_options=options)
    for i in (1, 2):
        sharded.save_state(
            store,
            f"s{i}",
            state(i),
            files={"extra.pt": {"step": i}},
            progress={"samples_seen": 10 * i},
            writer=Writer.current(1),
        )
    return store


def flip_a_byte(store: CheckpointStore, key: str) -> None:
    data = bytearray(store.storage.get(key))
    data[len(data) // 2] ^= 1
    store.storage.put(key, bytes(data))


def test_the_manifest_lists_every_file_of_the_folder_with_its_size_and_sha256(backend):
    store = two_sharded(backend)
    info = store.latest()
    assert info.name == "s2" and info.manifest.metadata == {"format": "dcp", "world_size": 1}
    on_store = store.storage.sizes("checkpoints/s2")
    assert set(info.manifest.files) == set(on_store) - {"manifest.json"}
    assert {".metadata", "__0_0.distcp", "__0_small.distcp", "extra.pt"} == set(info.manifest.files)
    for fname, entry in info.manifest.files.items():
        data = store.storage.get(f"checkpoints/s2/{fname}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256)
    assert store.check("s2", deep=True) == []


def test_a_sharded_checkpoint_loads_back_exactly(backend):
    store = two_sharded(backend)
    target, saved = blank(), state(2)
    read = sharded.load_state(store, store.latest(), target)
    assert torch.equal(target["model"]["big.weight"], saved["model"]["big.weight"])
    assert torch.equal(target["model"]["big.bias"], saved["model"]["big.bias"])
    assert target["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    assert torch.equal(target["optimizer"]["state"]["big.weight"]["step"], torch.tensor(2.0))
    assert sorted(read) == [".metadata", "__0_0.distcp", "__0_small.distcp"]
    assert sharded.load_files(store, store.latest(), ["extra.pt", "extra-rank7.pt"]) == {"extra.pt": {"step": 2}}


@pytest.mark.parametrize("fname", ["__0_0.distcp", "__0_small.distcp", ".metadata", "extra.pt"])
def test_a_flipped_byte_in_any_file_raises_corrupt_on_load_and_verify_names_it(backend, fname):
    store = two_sharded(backend)
    flip_a_byte(store, f"checkpoints/s2/{fname}")
    assert store.check("s2") == []  # same size: only the hash tells
    assert store.check("s2", deep=True) == [f"s2/{fname}: sha256 mismatch"]
    with pytest.raises(CorruptCheckpointError, match=rf"s2/{fname}: .* does not match the manifest"):
        sharded.load_files(store, store.latest(), ["extra.pt"])  # what FSDP's load reads first
        sharded.load_state(store, store.latest(), blank())


def test_a_file_that_dcp_metadata_names_but_the_manifest_does_not_is_refused(backend):
    store = two_sharded(backend)
    info = store.latest()
    files = {k: v for k, v in info.manifest.files.items() if k != "__0_0.distcp"}
    store.storage.put("checkpoints/s2/manifest.json", Manifest(**{**info.manifest.__dict__, "files": files}).to_json())
    assert store.check("s2", deep=True) == []  # what the manifest lists is fine ...
    with pytest.raises(CorruptCheckpointError, match=r"does not list: \['__0_0.distcp'\]"):
        sharded.load_state(store, store.info("s2"), blank())  # ... but DCP would read an unlisted file


class _RunsAShellCommand:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_metadata_pickle_is_hashed_before_it_is_unpickled(backend, tmp_path):
    store, marker = two_sharded(backend), tmp_path / "pwned"
    store.storage.put("checkpoints/s2/.metadata", pickle.dumps(_RunsAShellCommand(str(marker))))
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest"):
        sharded.load_state(store, store.info("s2"), blank())
    assert not marker.exists()


def test_a_malicious_metadata_pickle_vouched_for_by_a_forged_manifest_is_refused(backend, tmp_path):
    """The manifest is trusted only as far as the store's checks go: an attacker who rewrites it too still
    meets the allow-list of DCP's classes."""
    store, marker = two_sharded(backend), tmp_path / "pwned"
    payload = pickle.dumps(_RunsAShellCommand(str(marker)))
    store.storage.put("checkpoints/s2/.metadata", payload)
    info = store.info("s2")
    files = {**info.manifest.files, ".metadata": type(info.manifest.files[".metadata"])(len(payload), _sha(payload))}
    store.storage.put("checkpoints/s2/manifest.json", Manifest(**{**info.manifest.__dict__, "files": files}).to_json())
    with pytest.raises(UnsafeCheckpointError, match=r"posix.system is not part of DCP's metadata"):
        sharded.load_state(store, store.info("s2"), blank())
    assert not marker.exists()


def test_a_non_tensor_value_that_would_run_code_is_refused_weights_only(backend, tmp_path):
    folder, options = backend
    store, marker = CheckpointStore(folder, "r", storage_options=options), tmp_path / "pwned"
    info = sharded.save_state(
        store, "s1", {"model": {"w": torch.ones(2)}, "evil": _RunsAShellCommand(str(marker))}, progress={}
    )
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        sharded.load_state(store, info, {"model": {"w": torch.zeros(2)}, "evil": None})
    assert not marker.exists()


def test_a_stale_writer_writes_no_shard_and_leaves_latest_alone(backend):
    store = two_sharded(backend)
    store.claim_generation()
    store.claim_generation()  # generation 2 now owns the run
    with pytest.raises(FencedError):
        sharded.save_state(store, "s3", state(3), progress={"samples_seen": 30}, writer=Writer.current(1))
    assert not store.storage.exists("checkpoints/s3")
    assert store.read_pointer()["name"] == "s2"


def test_export_of_a_sharded_checkpoint_writes_the_consolidated_model(backend, tmp_path):
    store = two_sharded(backend)
    _folder, options = backend
    out = str(tmp_path / "model.pt")
    assert cli(["export", store.uri, out, "--storage-options", json.dumps(options or {})]) == 0
    exported = torch.load(out, weights_only=True)
    assert exported["model"].keys() == state(2)["model"].keys()
    assert all(torch.equal(exported["model"][k], v) for k, v in state(2)["model"].items())
    assert exported["metadata"]["progress"] == {"samples_seen": 20}
    assert cli(["export", f"{store.uri}/checkpoints/s1", out, "--storage-options", json.dumps(options or {})]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["model"]["big.bias"], torch.full((3,), 1.0))


def test_verify_cli_checks_a_sharded_checkpoint_like_any_other(backend):
    store = two_sharded(backend)
    options = json.dumps(backend[1] or {})
    assert cli(["verify", store.uri, "--storage-options", options]) == 0
    flip_a_byte(store, "checkpoints/s1/__0_0.distcp")
    assert cli(["verify", store.uri, "--storage-options", options]) == 1


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- links in a local run folder -------------------------------------------------------------------
def test_a_shard_replaced_by_a_symlink_is_refused_not_followed(tmp_path):
    store = two_sharded((str(tmp_path / "runs"), None))
    shard = tmp_path / "runs/r/checkpoints/s2/__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(shard.read_bytes())  # the very same bytes: only the link itself is wrong
    shard.unlink()
    shard.symlink_to(outside)
    assert store.check("s2") == ["s2/__0_0.distcp: a symbolic link or special file (never followed)"]
    assert store.latest().name == "s1"  # the damaged newest checkpoint is skipped
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp: a symbolic link \(never followed\)"):
        sharded.load_state(store, store.info("s2"), blank())  # nor does the loader, asked for it directly


def test_a_checkpoint_folder_that_links_out_of_the_run_is_refused(tmp_path):
    store = two_sharded((str(tmp_path / "runs"), None))
    folder = tmp_path / "runs/r/checkpoints/s2"
    folder.rename(tmp_path / "elsewhere")
    folder.symlink_to(tmp_path / "elsewhere")
    assert store.info("s2") is None  # a linked folder is never entered: it reads as missing
    assert store.latest().name == "s1" and (tmp_path / "elsewhere/.metadata").exists()


def test_local_fsspec_urls_work_too(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/runs", "r")
    info = sharded.save_state(store, "s", state(1), progress={})
    target = blank()
    sharded.load_state(store, info, target)
    assert torch.equal(target["model"]["big.weight"], state(1)["model"]["big.weight"])
    with fsspec.open(f"file://{tmp_path}/runs/r/latest") as f:
        assert json.loads(f.read())["name"] == "s"


def test_a_ddp_launch_on_a_sharded_run_is_refused_not_silently_restarted(tmp_path, make_config):
    """Without the check, the DDP loader finds no state.pt in any checkpoint and would fall back past all of
    them: a fresh start over a run that has checkpoints."""
    from training.config import ConfigError
    from training.unit.loop import run_unit

    two_sharded((str(tmp_path / "runs"), None))
    with pytest.raises(ConfigError, match=r"checkpoint s2 is sharded \(written with parallelism='fsdp'\)"):
        run_unit(make_config(save_folder=str(tmp_path / "runs"), run_name="r"))


def test_a_run_without_fsdp_refuses_its_sharded_latest_in_one_line_naming_the_fix(tmp_path, make_config, train_run):
    """The check reads the manifest alone (CheckpointInfo.sharded): a run that never shards does not import DCP."""
    from training.config import ConfigError

    config = make_config(run_name="r")
    store = CheckpointStore(config.save_folder, "r")
    sharded.save_state(store, "s1", state(1), progress={"samples_seen": 10}, writer=Writer.current(1))
    assert store.latest().sharded and sharded.is_sharded(store.latest())
    with pytest.raises(ConfigError, match=r"checkpoint s1 is sharded \(written with parallelism='fsdp'\); resume it "
                                          r"with parallelism='fsdp'.*python -m checkpointing export"):  # fmt: skip
        train_run(config)
    assert store.read_pointer()["name"] == "s1" and [i.name for i in store.list()] == ["s1"]
