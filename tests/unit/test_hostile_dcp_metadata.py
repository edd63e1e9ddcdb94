"""A hostile DCP ``.metadata`` that a forged manifest vouches for: BUILD cannot reach a class or a shared object,
and whatever does not unpickle into DCP's metadata shape is one typed error naming the file (issue 20, item 7a).
The pickles are written opcode by opcode, as an attacker would."""

from __future__ import annotations

import dataclasses
import pickle
import pickletools
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp

from checkpointing import CorruptCheckpointError, UnsafeCheckpointError
from checkpointing.commit import sharded
from tests.conftest import ROOT
from tests.hostile import run_of, vouch

P = pickle
DCP = b"torch.distributed.checkpoint.metadata"


def global_(module: bytes, name: bytes) -> bytes:
    return P.GLOBAL + module + b"\n" + name + b"\n"


def text(value: str) -> bytes:
    data = value.encode()
    return P.BINUNICODE + len(data).to_bytes(4, "little") + data


def build_attribute(target: bytes, name: str) -> bytes:
    """``target`` (opcodes that push an object), then BUILD with state (None, {name: 1}): pickle sets the
    attribute with setattr, on whatever the target is."""
    return (
        P.PROTO
        + b"\x02"
        + target
        + P.NONE
        + P.EMPTY_DICT
        + text(name)
        + P.BININT1
        + b"\x01"
        + P.SETITEM
        + P.TUPLE2
        + P.BUILD
        + P.STOP
    )


def sharded_run(tmp_path):
    store = run_of((str(tmp_path / "runs"), None), epochs=0)
    sharded.save_state(store, "s1", {"model": {"w": torch.ones(4)}}, progress={"samples_seen": 4})
    return store


def load(store):
    return sharded.load_state(store, store.info("s1"), {"model": {"w": torch.zeros(4)}})


def test_build_on_a_dcp_class_is_refused_and_leaves_the_class_unchanged(tmp_path):
    payload = build_attribute(global_(DCP, b"Metadata"), "pwned_class")
    assert [op.name for op, _, _ in pickletools.genops(payload)][-2:] == ["BUILD", "STOP"]
    store = sharded_run(tmp_path)
    vouch(store, "s1", {".metadata": payload})
    with pytest.raises(UnsafeCheckpointError, match=r"s1/\.metadata: BUILD on the class Metadata: only new instances"):
        load(store)
    assert not hasattr(dcp.Metadata, "pwned_class")
    # The payload is real: pickle's own unpickler sets the attribute on the class for the rest of the process.
    probe = f"import pickle; from torch.distributed.checkpoint import metadata as m; pickle.loads({payload!r}); print(m.Metadata.pwned_class)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True).stdout == "1\n"


@pytest.mark.parametrize(
    "target, what",
    [
        (global_(b"torch", b"float32"), "a dtype"),  # a process-wide singleton that find_class hands out
        (global_(DCP, b"_MEM_FORMAT_ENCODING") + P.BININT1 + b"\x00" + P.TUPLE1 + P.REDUCE, "a _MEM_FORMAT_ENCODING"),
        (global_(b"torch", b"Size") + P.EMPTY_TUPLE + P.TUPLE1 + P.REDUCE, "a Size"),
    ],
    ids=["dtype", "enum member", "torch.Size"],
)
def test_build_on_an_object_that_is_not_a_fresh_dcp_instance_is_refused(tmp_path, target, what):
    store = sharded_run(tmp_path)
    vouch(store, "s1", {".metadata": build_attribute(target, "pwned")})
    with pytest.raises(UnsafeCheckpointError, match=rf"\.metadata: BUILD on {what}: only new instances"):
        load(store)
    assert not hasattr(dcp._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, "pwned")


def _storage_with_transform(store) -> bytes:
    metadata = sharded.read_dcp_metadata(store, store.info("s1"))
    index, where = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = dataclasses.replace(where, transform_descriptors=["stream.zstd"])
    return pickle.dumps(metadata)


def _chunk_without_location(store) -> bytes:
    metadata = sharded.read_dcp_metadata(store, store.info("s1"))
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != "model.w"}
    return pickle.dumps(metadata)


SHAPES = {
    "truncated": (lambda store: store.storage.get("checkpoints/s1/.metadata")[:-30], "that unpickles"),
    "a str for the entries": (
        lambda store: P.PROTO + b"\x02" + global_(DCP, b"Metadata") + text("x") + P.TUPLE1 + P.REDUCE + P.STOP,
        "state_dict_metadata is not a dict by name",
    ),
    "no file locations": (
        lambda store: P.PROTO + b"\x02" + global_(DCP, b"Metadata") + P.EMPTY_DICT + P.TUPLE1 + P.REDUCE + P.STOP,
        "storage_data is not a dict of file locations",
    ),
    "a chunk without a location": (_chunk_without_location, "an entry has no file location"),
    "an unknown layout": (
        lambda store: (
            P.PROTO
            + b"\x02"
            + global_(b"torch.serialization", b"_get_layout")
            + text("nope")
            + P.TUPLE1
            + P.REDUCE
            + P.STOP
        ),
        "that unpickles (KeyError)",
    ),
    "a stream transform": (_storage_with_transform, "storage_data is not a dict of file locations"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_metadata_of_the_wrong_shape_is_one_corrupt_checkpoint_error_naming_the_file(tmp_path, shape):
    store = sharded_run(tmp_path)
    make, problem = SHAPES[shape]
    vouch(store, "s1", {".metadata": make(store)})
    with pytest.raises(CorruptCheckpointError, match=r"s1/\.metadata: not DCP metadata") as info:
        load(store)
    assert problem in str(info.value)
