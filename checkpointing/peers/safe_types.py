"""The few harmless types other trainers pickle beside their tensors, admitted without running their code.

``torch.load(weights_only=True)`` refuses any global it does not know. Real checkpoints of the peers hold a few:
Composer's RNG state has NumPy arrays and its timestamps ``datetime.timedelta``; Lightning's ``hyper_parameters``
hold whatever the user passed (``pathlib`` paths, NumPy scalars, timedeltas); Ray users ``torch.save`` dicts with
``datetime`` values. Allowing NumPy's own reconstructors would let a file call NumPy's C code with arguments of its
choosing (``_reconstruct`` allocates any shape it is given; object dtypes; ``dtype.__setstate__``), so each allowed
global name is bound here to a small function of ours that accepts only the arguments the real writer produces,
in the form it produces them, and builds the value from plain Python and torch:

- NumPy arrays become torch tensors of the same dtype and shape (numeric dtypes only, little-endian or single
  byte; the byte count must match the shape), NumPy scalars Python numbers, NumPy dtypes only exist while loading;
- ``datetime.timedelta``/``datetime``/``date``/``timezone`` are built from checked integers and bytes;
- ``pathlib`` paths become *pure* paths (no file system methods), ``torch.torch_version.TorchVersion`` a ``str``.

Anything else stays refused by torch. The names are admitted with ``torch.serialization.safe_globals`` around one
load only (the context manager changes a process-wide set for its duration, so what it adds must be harmless to
any load that runs meanwhile: these functions are). The objects that exist only while loading are registered under
names no GLOBAL opcode can spell (they contain a newline), so a file cannot reach them except through the
functions above.
"""

from __future__ import annotations

import datetime
import math
import pathlib
import pickle
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from checkpointing.errors import UnsafeCheckpointError
from checkpointing.serialization import safe_load

# NumPy's type codes for the dtypes a peer's numbers come in -> (torch dtype, struct format or None)
_NUMERIC = {
    "b1": (torch.bool, "?"),
    "i1": (torch.int8, "b"),
    "u1": (torch.uint8, "B"),
    "i2": (torch.int16, "h"),
    "u2": (torch.uint16, "H"),
    "i4": (torch.int32, "i"),
    "u4": (torch.uint32, "I"),
    "i8": (torch.int64, "q"),
    "u8": (torch.uint64, "Q"),
    "f2": (torch.float16, "e"),
    "f4": (torch.float32, "f"),
    "f8": (torch.float64, "d"),
}
_MAX_DIMS = 32
_MAX_DEPTH = 200  # containers in containers; the peers' files go about 10 deep


class _Refused(pickle.UnpicklingError):
    """An allowed name called with arguments its real writer never produces."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise _Refused(f"{what}: not in the form its writer produces")


def _is_int(value: Any) -> bool:
    return type(value) is int


class _Dtype:
    """``numpy.dtype(code, False, True)`` followed by BUILD of its 8-tuple state: a plain numeric dtype only."""

    def __init__(self, code: str):
        self.code, self.byteorder = code, "="

    def __setstate__(self, state: Any) -> None:
        _require(type(state) is tuple and len(state) in (8, 9) and _is_int(state[0]), "numpy dtype state")
        _require(state[1] in ("<", "|", "=") and state[2:5] == (None, None, None), "numpy dtype state")
        _require(all(_is_int(v) for v in state[5:]), "numpy dtype state")
        self.byteorder = state[1]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _NUMERIC[self.code][0]


class _Array:
    """``numpy._core.multiarray._reconstruct(ndarray, (0,), b'b')`` followed by BUILD of
    ``(1, shape, dtype, is_fortran, raw_bytes)``; becomes a tensor once the whole file is read."""

    tensor: torch.Tensor | None = None

    def __setstate__(self, state: Any) -> None:
        _require(type(state) is tuple and len(state) == 5 and state[0] == 1, "numpy array state")
        _, shape, dtype, fortran, raw = state
        _require(type(shape) is tuple and len(shape) <= _MAX_DIMS, "numpy array shape")
        _require(all(_is_int(n) and n >= 0 for n in shape), "numpy array shape")
        _require(type(dtype) is _Dtype and type(fortran) is bool and type(raw) is bytes, "numpy array state")
        _require(self.tensor is None, "numpy array state set twice")
        count = math.prod(shape)
        _require(count * dtype.torch_dtype.itemsize == len(raw), "numpy array size")
        flat = (
            torch.frombuffer(bytearray(raw), dtype=dtype.torch_dtype)
            if count
            else torch.empty(0, dtype=dtype.torch_dtype)
        )
        self.tensor = (
            flat.reshape(shape[::-1]).permute(*reversed(range(len(shape)))) if fortran else flat.reshape(shape)
        )


def _ndarray(*args: Any) -> Any:
    raise _Refused("numpy.ndarray: only an argument of _reconstruct, never called")


def _reconstruct(*args: Any) -> _Array:
    _require(len(args) == 3 and args[0] is _ndarray and args[1] == (0,) and args[2] == b"b", "numpy _reconstruct")
    return _Array()


def _numpy_dtype(*args: Any) -> _Dtype:
    _require(len(args) == 3 and type(args[0]) is str and args[0] in _NUMERIC, "numpy dtype")
    _require(args[1] is False and args[2] is True, "numpy dtype")
    return _Dtype(args[0])


def _numpy_scalar(*args: Any) -> bool | int | float:
    _require(len(args) == 2 and type(args[0]) is _Dtype and type(args[1]) is bytes, "numpy scalar")
    dtype, raw = args
    fmt = _NUMERIC[dtype.code][1]
    _require(struct.calcsize(fmt) == len(raw), "numpy scalar size")
    return struct.unpack(f"<{fmt}", raw)[0]


def _timedelta(*args: Any) -> datetime.timedelta:
    _require(len(args) == 3 and all(_is_int(a) for a in args), "datetime.timedelta")
    try:
        return datetime.timedelta(days=args[0], seconds=args[1], microseconds=args[2])
    except OverflowError as exc:
        raise _Refused("datetime.timedelta: out of range") from exc


def _timezone(*args: Any) -> datetime.timezone:
    _require(len(args) in (1, 2) and type(args[0]) is datetime.timedelta, "datetime.timezone")
    _require(len(args) == 1 or type(args[1]) is str, "datetime.timezone")
    try:
        return datetime.timezone(*args)
    except ValueError as exc:
        raise _Refused("datetime.timezone: out of range") from exc


def _date_or_datetime(kind: type, size: int) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        _require(len(args) in (1, 2) and type(args[0]) is bytes and len(args[0]) == size, kind.__name__)
        _require(len(args) == 1 or (kind is datetime.datetime and type(args[1]) is datetime.timezone), kind.__name__)
        try:
            return kind(*args)  # the C constructor's own pickle path: fixed-size bytes, checked fields
        except (TypeError, ValueError) as exc:
            raise _Refused(f"{kind.__name__}: out of range") from exc

    return build


def _path(kind: type) -> Callable[..., pathlib.PurePath]:
    def build(*args: Any) -> pathlib.PurePath:
        _require(all(type(a) is str for a in args), "pathlib path")
        return kind(*args)

    return build


class _VersionString(str):
    """``torch.torch_version.TorchVersion`` (a ``str`` subclass, made with NEWOBJ): becomes a plain ``str``."""

    __slots__ = ()

    def __new__(cls, *args: Any) -> _VersionString:
        _require(len(args) == 1 and type(args[0]) is str, "torch.torch_version.TorchVersion")
        return super().__new__(cls, args[0])


def _names(modules: tuple[str, ...], name: str) -> list[str]:
    return [f"{module}.{name}" for module in modules]


_NUMPY_CORE = ("numpy._core.multiarray", "numpy.core.multiarray")  # NumPy 2 writes the first, NumPy 1 the second
_PATHLIB = ("pathlib", "pathlib._local")  # Python <= 3.12, 3.13+
_ALLOWED: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    *((_reconstruct, n) for n in _names(_NUMPY_CORE, "_reconstruct")),
    *((_numpy_scalar, n) for n in _names(_NUMPY_CORE, "scalar")),
    (_ndarray, "numpy.ndarray"),
    (_numpy_dtype, "numpy.dtype"),
    (_timedelta, "datetime.timedelta"),
    (_timezone, "datetime.timezone"),
    (_date_or_datetime(datetime.datetime, 10), "datetime.datetime"),
    (_date_or_datetime(datetime.date, 4), "datetime.date"),
    *((_path(pathlib.PurePosixPath), n) for n in _names(_PATHLIB, "PosixPath") + _names(_PATHLIB, "PurePosixPath")),
    *(
        (_path(pathlib.PureWindowsPath), n)
        for n in _names(_PATHLIB, "WindowsPath") + _names(_PATHLIB, "PureWindowsPath")
    ),
    (_VersionString, "torch.torch_version.TorchVersion"),
    # Built only by the functions above; BUILD needs them allow-listed, and no GLOBAL can spell these names.
    (_Dtype, "\nnumpy dtype while loading"),
    (_Array, "\nnumpy array while loading"),
]
_ONE_AT_A_TIME = threading.Lock()
ALLOWED_GLOBALS = sorted(e[1] for e in _ALLOWED if isinstance(e, tuple) and not e[1].startswith("\n"))


def load_with_peer_types(data: bytes, where: str) -> Any:
    """``safe_load`` with the peers' harmless types admitted for this one load; NumPy values come back as tensors
    and Python numbers, paths as pure paths. A file that needs anything else raises UnsafeCheckpointError naming
    ``where`` only (never the file's content, which may be another team's)."""
    try:
        with _ONE_AT_A_TIME, torch.serialization.safe_globals(_ALLOWED):  # its exit removes them for every thread
            obj = safe_load(data, where)
    except UnsafeCheckpointError as exc:
        if not isinstance(exc.__cause__, pickle.UnpicklingError):
            raise  # safe_load's other refusals (a size bound) say what they are
        raise UnsafeCheckpointError(
            f"{where}: refused: the file needs code to load (a type outside the allow-list of harmless types, or "
            f"an allowed type in a form its writer never produces); weights are only read with "
            f"torch.load(weights_only=True) and the types listed in docs/migrating.md. Re-save it as a state_dict "
            f"of tensors, or as .safetensors"
        ) from exc
    return _finish(obj, where, {})


def _finish(value: Any, where: str, memo: dict[int, tuple[Any, Any]], depth: int = 0) -> Any:
    """Replaces the stand-ins of one load by their values. ``memo`` visits each container once (a file can share
    one list many times over: walking it per reference would take exponential time) and ends cycles."""
    if id(value) in memo:
        return memo[id(value)][1]
    if depth > _MAX_DEPTH:
        raise UnsafeCheckpointError(f"{where}: refused: nested more than {_MAX_DEPTH} levels deep")
    kind = type(value)
    if kind is _Array:
        if value.tensor is None:
            raise UnsafeCheckpointError(f"{where}: refused: a NumPy array without its data")
        result: Any = value.tensor
    elif kind is _Dtype:
        result = str(value.torch_dtype)  # a dtype kept as a value: its name is all it says
    elif kind is _VersionString:
        result = str(value)
    elif isinstance(value, dict):
        memo[id(value)] = (value, value)
        items = [(_finish(k, where, memo, depth + 1), _finish(v, where, memo, depth + 1)) for k, v in value.items()]
        value.clear()
        value.update(items)
        result = value
    elif kind is list:
        memo[id(value)] = (value, value)
        value[:] = [_finish(v, where, memo, depth + 1) for v in value]
        result = value
    elif kind in (tuple, set):
        result = kind(_finish(v, where, memo, depth + 1) for v in value)
    else:
        return value
    memo[id(value)] = (value, result)  # holding ``value`` keeps its id from being reused by a new object
    return result
