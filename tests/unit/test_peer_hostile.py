"""Hostile variants of every peer format: what the allow-list admits must not become a way to run code, allocate
without bound, or read outside the folder. Each is refused with UnsafeCheckpointError or WeightsError naming the
file and the problem, never quoting the file's content, and nothing it asks for happens."""

from __future__ import annotations

import datetime
import io
import json
import os
import pathlib
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch

from checkpointing import UnsafeCheckpointError
from checkpointing.peers.formats import read_peer_checkpoint, read_weights
from checkpointing.peers.safe_types import load_with_peer_types
from checkpointing.peers.weights import WeightsError
from tests.interop_stores import torch_bytes

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
RAY = next((PEERS / "ray").iterdir())
REFUSED = (UnsafeCheckpointError, WeightsError)


# -- a pickle written opcode by opcode (protocol 2, as torch.save writes), inside torch.save's zip ----------
def G(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def S(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def I(n: int) -> bytes:  # noqa: E743 (an opcode, like the others)
    return b"J" + struct.pack("<i", n)


def B(raw: bytes) -> bytes:
    """bytes as NumPy and datetime pickle them under protocol 2: _codecs.encode(latin-1 text, 'latin1')."""
    return G("_codecs", "encode") + b"(" + S(raw.decode("latin1")) + S("latin1") + b"tR"


def T(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def call(func: bytes, *args: bytes) -> bytes:
    return func + T(*args) + b"R"


def dtype(code: str, state: bytes | None = None) -> bytes:
    state = state or T(I(3), S("<"), b"N", b"N", b"N", I(-1), I(-1), I(0))
    return call(G("numpy", "dtype"), S(code), b"\x89", b"\x88") + state + b"b"


def array(shape: tuple[int, ...], code: str, raw: bytes) -> bytes:
    empty = call(G("numpy._core.multiarray", "_reconstruct"), G("numpy", "ndarray"), T(I(0)), B(b"b"))
    return empty + T(I(1), T(*map(I, shape)), dtype(code), b"\x89", B(raw)) + b"b"


def torch_file(body: bytes) -> bytes:
    """A torch.save zip whose data.pkl is ``{'state': {'model': {}, 'timestamp': <body>}}`` (Composer's layout)."""
    pkl = b"\x80\x02}" + S("state") + b"}" + S("model") + b"}s" + S("timestamp") + body + b"ss."
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def refused(tmp_path: Path, data: bytes, name: str = "evil.pt") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(REFUSED) as info:
        read_peer_checkpoint(str(path))
    message = str(info.value)
    assert message.startswith(f"load_path={str(path)!r}: ") and "\n" not in message
    return message


def test_the_opcode_builder_writes_what_the_reader_accepts():
    """The hostile files below differ from this one only where they say: it loads."""
    body = T(array((2, 3), "u4", bytes(range(24))), call(G("datetime", "timedelta"), I(1), I(2), I(3)))
    arr, delta = load_with_peer_types(torch_file(body), "t")["state"]["timestamp"]
    assert (
        arr.dtype == torch.uint32
        and arr.shape == (2, 3)
        and int(arr[0, 1]) == int.from_bytes(bytes(range(4, 8)), "little")
    )
    assert delta == datetime.timedelta(days=1, seconds=2, microseconds=3)


# -- code ------------------------------------------------------------------------------------------------
class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "layout",
    [
        lambda p: {"state": {"model": {}, "timestamp": {"Timestamp": p}}, "rng": []},  # Composer
        lambda p: {"state_dict": {}, "pytorch-lightning_version": "2.6.6", "hyper_parameters": {"x": p}},  # Lightning
        lambda p: {"model": {}, "saved_at": p},  # a Ray user's dict
    ],
    ids=["composer", "lightning", "ray"],
)
def test_os_system_through_reduce_is_refused_in_every_layout_and_runs_nothing(layout, tmp_path):
    marker = tmp_path / "PWNED"
    problem = refused(tmp_path, torch_bytes(layout(Payload(marker)))).split(": ", 1)[1]
    assert "needs code to load" in problem and "touch" not in problem and "system" not in problem
    assert not marker.exists()


def test_os_system_inside_a_ray_folder_or_a_pytorch_model_bin_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    for folder, name in (("ray", "checkpoint.pt"), ("hf", "pytorch_model.bin")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes(torch_bytes({"model": {"w": torch.zeros(1)}, "x": Payload(marker)}))
        with pytest.raises(UnsafeCheckpointError, match=rf"^load_path='{tmp_path / folder}' \({name}\): refused"):
            read_weights(str(tmp_path / folder))
    assert not marker.exists()


class SneakyPath(pathlib.PurePosixPath):
    pass


class SneakyDelta(datetime.timedelta):
    pass


@pytest.mark.parametrize("value", [SneakyPath("a"), SneakyDelta(1)], ids=["PurePosixPath", "timedelta"])
def test_a_subclass_of_an_allowed_type_is_refused(value, tmp_path):
    refused(tmp_path, torch_bytes({"state": {"model": {}, "timestamp": value}}))


def test_the_stand_ins_cannot_be_named_by_a_file(tmp_path):
    for name in ("_Array", "_Dtype", "_reconstruct"):
        refused(tmp_path, torch_file(call(G("checkpointing.peers.safe_types", name))))


# -- NumPy's reconstructors abused ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        call(G("numpy._core.multiarray", "_reconstruct"), G("numpy", "ndarray"), T(I(10**9)), B(b"b")),  # allocate
        call(G("numpy._core.multiarray", "_reconstruct"), G("numpy", "dtype"), T(I(0)), B(b"b")),  # another subtype
        call(G("numpy", "ndarray"), T(I(0))),  # ndarray called directly
        array((10**9,), "f4", b"\x00" * 8),  # a shape its bytes do not fill
        array((2,), "O", b"\x00" * 16),  # object dtype: Python objects inside an array
        array((2,), "V8", b"\x00" * 16),  # void/structured
        dtype("f8", T(I(3), S("<"), b"N", T(S("a")), b"N", I(-1), I(-1), I(0))),  # dtype state with field names
        dtype("f8", T(I(3), S(">"), b"N", b"N", b"N", I(-1), I(-1), I(0))),  # big-endian
        array((1,), "f8", b"\x00" * 8) + T(I(1), T(I(1)), dtype("f8"), b"\x89", B(b"\x00" * 8)) + b"b",  # twice
        call(G("numpy._core.multiarray", "_reconstruct"), G("numpy", "ndarray"), T(I(0)), B(b"b")),  # no data
        call(G("numpy._core.multiarray", "scalar"), dtype("i8"), B(b"\x00" * 3)),  # scalar of the wrong size
        G("numpy", "dtype") + T(S("f8"), b"\x89", b"\x88") + b"\x81",  # NEWOBJ on an allowed function
    ],
    ids=[
        "huge shape",
        "other subtype",
        "ndarray called",
        "short data",
        "object dtype",
        "void dtype",
        "dtype fields",
        "big-endian",
        "array built twice",
        "array without data",
        "bad scalar",
        "newobj",
    ],
)
def test_numpys_allowed_names_take_only_what_numpy_writes(body, tmp_path):
    started = time.monotonic()
    message = refused(tmp_path, torch_file(body))
    assert time.monotonic() - started < 5  # refused, not allocated
    assert "evil" in message.split(": ", 1)[0]


# -- allowed types with hostile arguments or BUILD state -------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        call(G("datetime", "timedelta"), I(1), I(2), I(3)) + b"}" + S("days") + I(9) + b"sb",  # BUILD on a timedelta
        call(G("datetime", "timedelta"), I(10**9), I(0), I(0)),  # out of range (999999999 days at most)
        call(G("datetime", "timedelta"), S("1"), I(0), I(0)),  # a string where numbers belong
        call(G("datetime", "datetime"), B(b"\x07\xea\x0d\x18\n\x00\x00\x00\x00\x00")),  # month 13
        call(G("datetime", "datetime"), B(b"\x07\xea\x0b\x18\n\x00\x00\x00\x00\x00"), S("UTC")),  # a str as tzinfo
        call(G("pathlib", "PosixPath"), I(1)),  # not text
        call(G("pathlib", "PosixPath"), S("a")) + b"}" + S("_raw_paths") + S("/etc") + b"sb",  # BUILD on a path
        G("torch.torch_version", "TorchVersion") + T(I(2)) + b"\x81",  # not text
    ],
    ids=[
        "timedelta BUILD",
        "timedelta range",
        "timedelta text",
        "bad date",
        "tz not a timezone",
        "path of an int",
        "path BUILD",
        "version of an int",
    ],
)
def test_allowed_types_refuse_arguments_and_state_their_writers_never_produce(body, tmp_path):
    refused(tmp_path, torch_file(body))


def test_a_billion_laughs_of_shared_lists_is_read_in_linear_time(tmp_path):
    body = b"(]" + S("x") + b"a" + b"q\x00"  # memo 0 = ['x']; all levels end up in one tuple
    for i in range(1, 60):  # each level a list holding the level below twice: 2**59 leaves by reference
        body += b"](h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"e" + b"q" + bytes([i])
    started = time.monotonic()
    levels = load_with_peer_types(torch_file(body + b"t"), "laughs")["state"]["timestamp"]
    assert time.monotonic() - started < 5
    assert len(levels) == 60 and levels[-1][0] is levels[-1][1] is levels[-2]


def test_a_file_nested_past_the_bound_is_refused(tmp_path):
    body = b"]" * 300 + b"a" * 299
    message = refused(tmp_path, torch_file(body))
    assert "nested more than 200 levels deep" in message


# -- Hugging Face folders ------------------------------------------------------------------------------
def hf_folder(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(PEERS / "hf" / "sharded", folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize(
    "shard, problem",
    [
        ("../single/model.safetensors", "names a shard outside the folder"),
        ("/etc/passwd", "names a shard outside the folder"),
        ("missing.safetensors", "names the shard 'missing.safetensors', which the folder does not hold"),
    ],
)
def test_an_index_cannot_send_the_reader_outside_the_folder(shard, problem, tmp_path):
    folder = hf_folder(tmp_path, {"transformer.wte.weight": shard})
    with pytest.raises(WeightsError, match=rf"^load_path='{folder}' \(model.safetensors.index.json\): {problem}"):
        read_weights(str(folder))


def test_an_index_key_missing_from_its_shard_is_refused(tmp_path):
    folder = hf_folder(tmp_path, {"not.in.any.shard": "model-00001-of-00004.safetensors"})
    with pytest.raises(WeightsError, match=r"1 key\(s\) of the index are in no shard \(first 'not.in.any.shard'\)"):
        read_weights(str(folder))


def test_a_key_in_two_shards_is_refused(tmp_path):
    first = "model-00001-of-00004.safetensors"
    folder = hf_folder(tmp_path, {"transformer.wte.weight": first, "transformer.wpe.weight": "copy.safetensors"})
    shutil.copy(folder / first, folder / "copy.safetensors")  # the same tensors again under another shard name
    with pytest.raises(WeightsError, match=r"4 key\(s\) in more than one shard \(first 'transformer.h.0.ln_1.bias'\)"):
        read_weights(str(folder))


@pytest.mark.parametrize("make", [os.mkfifo, lambda p: os.symlink("/dev/zero", p)], ids=["fifo", "/dev/zero"])
def test_a_shard_that_is_not_a_regular_file_is_refused_without_blocking(make, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    make(str(folder / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"\(model.safetensors\): not a regular file"):
        read_weights(str(folder))


@pytest.mark.parametrize("target", ["../../secret.pt", "/etc/passwd", "other/ep2.pt", "x/checkpoints2/ep2.pt"])
def test_a_composer_symlink_file_cannot_point_outside_its_folder(target, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest-rank0.pt.symlink").write_text(target)
    with pytest.raises(WeightsError, match=r"the Composer .symlink points outside its own folder") as info:
        read_peer_checkpoint(str(tmp_path / "checkpoints" / "latest-rank0.pt.symlink"))
    assert target not in str(info.value)


# -- MindSpore's protobuf --------------------------------------------------------------------------------
def ms_value(tag: bytes, dims: list[int], kind: bytes, content: bytes) -> bytes:
    def ld(field: int, data: bytes) -> bytes:
        return bytes([field << 3 | 2]) + _varint(len(data)) + data

    tensor = b"".join(bytes([0x08]) + _varint(d) for d in dims) + ld(2, kind) + ld(3, content)
    return ld(1, ld(1, tag) + ld(2, tensor))


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


@pytest.mark.parametrize(
    "data, problem",
    [
        (ms_value(b"w", [10**9], b"Float32", b"\x00" * 8), "its size does not match its shape"),
        (ms_value(b"w", [2**40, 2**40, 0], b"Float32", b""), "more elements than a tensor can hold"),
        (ms_value(b"w", [1] * 33 + [0], b"Float32", b""), "its shape has more than 32 dims"),
        (ms_value(b"w", [2], b"Int4", b"\x00"), "a tensor type this reader does not know"),
        (ms_value(b"w", [2], b"Float32", b"\x00" * 8)[:-3], "runs past the end of the file"),
        (b"\x0a\x05\x0d\x00\x00\x00\x00", "wire type 5"),
        (b"\x0a\x05\x1a\x03abc", "holds a map tensor"),
        (ms_value(b"w", [2], b"Float32", b"\x00" * 8) + b"crc_num" + (1).to_bytes(10, "big"), "CRC32 does not match"),
    ],
    ids=["huge dims", "past int64", "33 dims", "4-bit type", "truncated", "wire type 5", "map tensor", "bad crc"],
)
def test_a_damaged_or_unsupported_mindspore_ckpt_is_refused_naming_the_problem(data, problem, tmp_path):
    message = refused(tmp_path, data, "evil.ckpt")
    assert problem in message
