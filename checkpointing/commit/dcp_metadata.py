"""DCP's ``.metadata``, unpickled without trusting it: an allow-list of DCP's own classes, BUILD only on fresh
instances of them, and every field typed before DCP reads it.

DCP reads ``.metadata`` with plain ``pickle``, which runs whatever the file asks. Here the file has already
been hashed against the manifest (sharded.py), and still: ``find_class`` hands out only DCP's metadata
classes, torch dtypes and ``torch.Size``; BUILD (pickle's "set this object's attributes") is refused unless its
target is an instance of one of those classes, because BUILD on a class object sets attributes of the class
itself for the rest of the process (C's unpickler cannot be told that, so pickle's Python unpickler is used:
``.metadata`` is small, a few KB per hundred tensors). Anything the file holds that is not DCP's metadata
shape is refused before DCP sees it, and every failure is typed: UnsafeCheckpointError for what the
allow-list refuses, CorruptCheckpointError for what does not unpickle or is of the wrong shape; both name
the file, neither quotes it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import metadata as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError
from checkpointing.io.untrusted import printable

_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}
# The classes whose instances DCP's pickle fills in with BUILD.
_BUILDABLE = (
    dcp.Metadata,
    dcp.MetadataIndex,
    dcp.StorageMeta,
    dcp.TensorProperties,
    dcp.TensorStorageMetadata,
    dcp.BytesStorageMetadata,
    dcp.ChunkStorageMetadata,
    _StorageInfo,
)
_UNPICKLING_FAILURES = (
    ValueError,
    TypeError,
    LookupError,
    AttributeError,
    EOFError,
    RecursionError,
    OverflowError,
    MemoryError,
)


_BUILD = pickle._Unpickler.dispatch[pickle.BUILD[0]]


class _Refused(pickle.UnpicklingError):
    """What the allow-list refuses (as opposed to a pickle that is merely broken)."""


def _guarded_build(unpickler: Any) -> None:
    """pickle's BUILD, once its target (under the state on the stack) is a DCP metadata instance."""
    stack = unpickler.stack
    target = stack[-2] if len(stack) >= 2 else None
    if isinstance(target, type) or not isinstance(target, _BUILDABLE):
        what = f"the class {target.__name__}" if isinstance(target, type) else f"a {type(target).__name__}"
        raise _Refused(f"BUILD on {what}: only new instances of DCP's metadata classes are built")
    _BUILD(unpickler)


class _MetadataUnpickler(pickle._Unpickler):
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
        **pickle._Unpickler.dispatch,
        pickle.BUILD[0]: _guarded_build,
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{printable(module)[:100]}.{printable(name)[:100]} is not part of DCP's metadata")


def load_metadata(data: bytes, where: str) -> dcp.Metadata:
    """``data`` unpickled by the allow-list and checked to be DCP metadata of the expected shape."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(f"{where}: {exc}; refusing it") from exc
    except (pickle.UnpicklingError, *_UNPICKLING_FAILURES) as exc:
        raise CorruptCheckpointError(f"{where}: not DCP metadata that unpickles ({type(exc).__name__})") from exc
    if not isinstance(metadata, dcp.Metadata):
        raise UnsafeCheckpointError(f"{where}: holds {type(metadata).__name__}, not DCP metadata")
    problem = _shape_problem(metadata)
    if problem:
        raise CorruptCheckpointError(f"{where}: not DCP metadata of the expected shape ({problem})")
    return metadata


def _shape_problem(metadata: dcp.Metadata) -> str | None:
    """What in ``metadata`` is not of the types DCP's loader relies on, or None."""
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        return "state_dict_metadata is not a dict by name"
    if not isinstance(storage, dict) or not all(_index_ok(k) and _storage_ok(v) for k, v in storage.items()):
        return "storage_data is not a dict of file locations"
    for fqn, value in entries.items():
        if isinstance(value, dcp.TensorStorageMetadata):
            if not _tensor_ok(value):
                return "a tensor entry has wrong properties, size or chunks"
            indexes = [dcp.MetadataIndex(fqn, chunk.offsets) for chunk in value.chunks]
        elif isinstance(value, dcp.BytesStorageMetadata):
            indexes = [dcp.MetadataIndex(fqn)]
        else:
            return "an entry is neither a tensor nor a bytes entry"
        if not all(index in storage for index in indexes):
            return "an entry has no file location"
    if metadata.planner_data is not None and not isinstance(metadata.planner_data, dict):
        return "planner_data is not a dict"
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, dcp.StorageMeta):
        return "storage_meta is not DCP's"
    return None


def _tensor_ok(value: dcp.TensorStorageMetadata) -> bool:
    props, size, chunks = value.properties, value.size, value.chunks
    return (
        isinstance(props, dcp.TensorProperties)
        and isinstance(props.dtype, torch.dtype)
        and _dims(size)
        and isinstance(chunks, list)
        and all(
            isinstance(c, dcp.ChunkStorageMetadata)
            and _dims(c.offsets)
            and _dims(c.sizes)
            and len(c.offsets) == len(c.sizes) == len(size)
            and all(o + n <= s for o, n, s in zip(c.offsets, c.sizes, size, strict=True))
            for c in chunks
        )
    )


def _index_ok(index: Any) -> bool:
    return (
        isinstance(index, dcp.MetadataIndex)
        and isinstance(index.fqn, str)
        and (index.offset is None or _dims(index.offset))
        and (index.index is None or _natural(index.index))
    )


def _storage_ok(info: Any) -> bool:
    """A file location; no transforms (DCP's stream extensions would decompress: nothing here writes them)."""
    return (
        isinstance(info, _StorageInfo)
        and isinstance(info.relative_path, str)
        and _natural(info.offset)
        and _natural(info.length)
        and not info.transform_descriptors
    )


def _dims(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(_natural(d) for d in value)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
