"""MindSpore's ``.ckpt`` files, read without MindSpore: its protobuf layout decoded by hand, tensors built by torch.

A MindSpore user hands over what ``mindspore.save_checkpoint`` or ``ModelCheckpoint`` wrote: a ``.ckpt`` (the
default) or, since MindSpore 2.3, a ``.safetensors`` with ``{"format": "ms"}`` in its header. The ``.ckpt`` is a
sequence of ``Checkpoint`` messages (``mindspore/train/checkpoint.proto``: ``Value{tag, TensorProto{dims,
tensor_type, tensor_content}}``), large tensors split into several values with the same tag, optionally followed by
``b"crc_num"`` and a 10-byte big-endian CRC32 (``crc_check=True``). Followed here: ``_exec_save`` and
``_parse_ckpt_proto`` of ``mindspore/train/serialization.py`` in mindspore 2.10.0. Protobuf holds no code; the
decoder below reads only the three messages above and refuses anything else (encrypted files, map tensors, 4-bit
types). A whole checkpoint also holds the optimizer's slots and counters: ``split`` tells them from the weights.
"""

from __future__ import annotations

import binascii
import math
from typing import Any

import torch

from checkpointing.errors import MindSporeFormatError

_TYPES = {
    "Float16": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float32": torch.float32,
    "Float64": torch.float64,
    "Int8": torch.int8,
    "UInt8": torch.uint8,
    "Int16": torch.int16,
    "UInt16": torch.uint16,
    "Int32": torch.int32,
    "UInt32": torch.uint32,
    "Int64": torch.int64,
    "UInt64": torch.uint64,
    "Bool": torch.bool,
}
_CRC_MARK = b"crc_num"
MAX_DIMS = 32  # MindSpore's own limit is 8 (kMaxDims); torch's 64
MAX_BYTES = 2**63 - 1  # what torch can address, counting every dim at least 1
# MindSpore optimizers keep one slot per parameter under these prefixes (Momentum, Adam/AdamWeightDecay/Lamb,
# Adagrad/FTRL, RMSProp): optimizer state, not weights.
_SLOTS = {"moments.": "momentum_buffer", "adam_m.": "exp_avg", "adam_v.": "exp_avg_sq", "accum.": "accum",
          "linear.": "linear", "mean_square.": "square_avg", "mean_grad.": "grad_avg", "moment.": "momentum_buffer"}  # fmt: skip
# Counters and hyper-parameters MindSpore's TrainOneStepCell, optimizers and ModelCheckpoint(append_info) add.
_BOOKKEEPING = {"global_step", "learning_rate", "momentum", "beta1_power", "beta2_power", "weight_decay", "epoch_num",
                "step_num", "loss_scale", "scale_sense", "current_iterator_step", "last_overflow_iterator_step",
                "global_batch_size"}  # fmt: skip


def looks_like_ckpt(data: bytes) -> bool:
    """A protobuf ``Checkpoint`` starts with field 1, length-delimited (0x0a)."""
    return data[:1] == b"\x0a"


def read_ckpt(data: bytes) -> dict[str, Any]:
    """``{tag: tensor or str}`` in the file's order; raises MindSporeFormatError for anything but the layout above."""
    if data[-17:-10] == _CRC_MARK:
        data, crc = data[:-17], int.from_bytes(data[-10:], "big")
        if binascii.crc32(data) != crc:
            raise MindSporeFormatError("its CRC32 does not match its content (damaged)")
    parts: dict[str, list[tuple[list[int], str, bytes]]] = {}
    for field, value in _fields(data, "Checkpoint"):
        if field != 1 or not isinstance(value, bytes):
            raise MindSporeFormatError("not a MindSpore checkpoint (or an encrypted one: decrypt it with MindSpore)")
        tag, tensor = _value(value)
        parts.setdefault(tag, []).append(tensor)
    return {tag: _tensor(tag, slices) for tag, slices in parts.items()}


def split(
    tensors: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """(weights, optimizer slots by parameter name ``{name: {"momentum_buffer": t}}``, bookkeeping values)."""
    weights: dict[str, torch.Tensor] = {}
    slots: dict[str, dict[str, torch.Tensor]] = {}
    other: dict[str, Any] = {}
    for key, value in tensors.items():
        prefix = next((p for p in _SLOTS if key.startswith(p)), None)
        if prefix is not None and isinstance(value, torch.Tensor):
            slots.setdefault(key[len(prefix) :], {})[_SLOTS[prefix]] = value
        elif key in _BOOKKEEPING or not isinstance(value, torch.Tensor):
            other[key] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        else:
            weights[key] = value
    return weights, slots, other


def _tensor(tag: str, slices: list[tuple[list[int], str, bytes]]) -> Any:
    dims, kind = slices[0][0], slices[0][1]
    content = b"".join(s[2] for s in slices)
    if kind == "str":
        try:
            return content.decode("utf-32-le").rstrip("\x00")
        except UnicodeDecodeError as exc:
            raise MindSporeFormatError(f"value {tag!r}: not a string") from exc
    dtype = _TYPES.get(kind)
    if dtype is None:
        raise MindSporeFormatError(f"value {tag!r}: a tensor type this reader does not know")
    shape = [] if dims == [0] else dims
    # torch sizes even an empty tensor's strides as the product of its dims (0 counted as 1): bounded before it is
    # asked, else dims that multiply past int64 beside a 0 escape as torch's RuntimeError
    if len(shape) > MAX_DIMS or math.prod(max(d, 1) for d in shape) * dtype.itemsize > MAX_BYTES:
        raise MindSporeFormatError(
            f"value {tag!r}: its shape has more than {MAX_DIMS} dims or more elements than a tensor can hold"
        )
    if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != len(content):
        raise MindSporeFormatError(f"value {tag!r}: its size does not match its shape")
    if not content:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(content), dtype=dtype).reshape(shape)


def _value(data: bytes) -> tuple[str, tuple[list[int], str, bytes]]:
    tag, tensor = None, None
    for field, value in _fields(data, "Value"):
        if field == 1 and isinstance(value, bytes):
            tag = _text(value, "a value's tag")
        elif field == 2 and isinstance(value, bytes):
            tensor = _tensor_proto(value)
        elif field == 3:
            raise MindSporeFormatError("holds a map tensor (MapParameter), which this reader does not load")
        else:
            raise MindSporeFormatError("a value of an unknown layout")
    if tag is None or tensor is None:
        raise MindSporeFormatError("a value without its tag or tensor")
    return tag, tensor


def _tensor_proto(data: bytes) -> tuple[list[int], str, bytes]:
    dims: list[int] = []
    kind, content = None, b""
    for field, value in _fields(data, "TensorProto"):
        if field == 1 and isinstance(value, int):
            dims.append(value - (1 << 64) if value >= 1 << 63 else value)
        elif field == 1 and isinstance(value, bytes):  # packed
            dims.extend(v for _, v in _varints(value))
        elif field == 2 and isinstance(value, bytes):
            kind = _text(value, "a tensor type")
        elif field == 3 and isinstance(value, bytes):
            content = value
        else:
            raise MindSporeFormatError("a tensor of an unknown layout")
    if kind is None:
        raise MindSporeFormatError("a tensor without its type")
    return dims, kind, content


def _text(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MindSporeFormatError(f"{what} is not text") from exc


def _fields(data: bytes, message: str) -> list[tuple[int, int | bytes]]:
    """Protobuf wire format: (field number, varint or bytes) for wire types 0 and 2 only."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, message)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos, message)
            out.append((field, value))
        elif wire == 2:
            size, pos = _varint(data, pos, message)
            if pos + size > len(data):
                raise MindSporeFormatError(f"a {message} runs past the end of the file (truncated?)")
            out.append((field, data[pos : pos + size]))
            pos += size
        else:
            raise MindSporeFormatError(f"a {message} field of wire type {wire}, which MindSpore never writes")
    return out


def _varints(data: bytes) -> list[tuple[int, int]]:
    out, pos = [], 0
    while pos < len(data):
        value, pos = _varint(data, pos, "packed dims")
        out.append((pos, value - (1 << 64) if value >= 1 << 63 else value))
    return out


def _varint(data: bytes, pos: int, message: str) -> tuple[int, int]:
    value = shift = 0
    for i in range(10):
        if pos + i >= len(data):
            break
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + i + 1
        shift += 7
    raise MindSporeFormatError(f"a {message} with a broken number (truncated or not protobuf)")
