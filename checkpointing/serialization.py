"""Bytes <-> objects for checkpoint files, and the rules that make loading safe: ``weights_only``, and a
bound on what a file may unpack to.

``torch.load`` reads torch.save's zip format through miniz, which also inflates deflate-compressed entries:
a 0.5 MB file can hold 512 MiB of tensors, past every bound a reader checked on the file's size. torch.save
never compresses, so ``check_unpacked_size`` reads the zip's central directory the way miniz does (the
end record at the end of the file, zip64 included) before torch sees a byte, and refuses compressed entries
and declared sizes beyond the file itself. Everything in this package that torch.loads bytes from a store
goes through ``safe_load`` or that check (sharded.py's DCP items, weights.py's weights files).

torch is imported on first use, so that the parts of the package that only read manifests (the
``ls``/``verify`` commands, the flow's planning) start without paying for it.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

from checkpointing.errors import CheckpointError as CheckpointError
from checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError
from checkpointing.io.untrusted import printable

ZIP_MAGIC = b"PK\x03\x04"  # what torch.load looks at to choose its zip reader
# torch.save writes 6 records plus one per storage; a checkpoint of a million tensors is far beyond any model
# here, and walking more records than that is time a hostile file should not get.
MAX_ZIP_ENTRIES = 1 << 20
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_ZIP64_EXTRA = 0x0001
_U32 = 0xFFFFFFFF


def serialize(objects: dict[str, Any]) -> dict[str, bytes]:
    """``torch.save`` of each object into bytes, by file name."""
    import torch

    blobs = {}
    for fname, obj in objects.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        blobs[fname] = buf.getvalue()
    return blobs


def safe_load(data: bytes, where: str) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and plain containers only, never code) of bytes whose
    zip entries unpack to no more than the file's size. UnsafeCheckpointError for what needs code or unpacks
    to more; CorruptCheckpointError for anything else torch cannot load."""
    import torch

    check_unpacked_size(data, where)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where} holds objects that only an unsafe unpickler could load; refusing it "
            f"(weights_only=True). If you wrote this file yourself, re-save it with tensors and plain "
            f"containers only. Detail: {_first_line(exc)}"
        ) from exc
    except (RuntimeError, EOFError, ValueError, TypeError, LookupError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"{where}: not a readable torch.save file ({type(exc).__name__}: {_first_line(exc)})"
        ) from exc


def check_unpacked_size(data: bytes | memoryview, where: str) -> None:
    """UnsafeCheckpointError unless every entry of the zip in ``data`` is stored uncompressed and their declared
    sizes add up to no more than ``data`` itself. Data that is not a zip passes: torch's legacy format stores
    tensors raw and torch checks each against its declared size before reading it."""
    view = memoryview(data).cast("B")
    if bytes(view[:4]) != ZIP_MAGIC:
        return
    try:
        unpacked = _stored_size(view)
    except (ValueError, struct.error) as exc:
        raise UnsafeCheckpointError(
            f"{where}: refused: {exc}; torch.save writes neither, and a file that has them may unpack to far "
            f"more than its size"
        ) from exc
    if unpacked > len(view):
        raise UnsafeCheckpointError(
            f"{where}: refused: its zip entries declare {unpacked} bytes, more than the file's {len(view)}; "
            f"entries that overlap unpack to more than the file holds"
        )


def _stored_size(view: memoryview) -> int:
    """The summed sizes of the zip's entries, as miniz (torch's zip reader) finds them: the end record that ends
    the file, the zip64 end record its locator names, then exactly that many central-directory records."""
    end = len(view) - _END.size
    if end < 0 or bytes(view[end : end + 4]) != b"PK\x05\x06":
        raise ValueError("its zip directory does not end the file (a comment or trailing data)")
    _, disk, cd_disk, n_disk, n, cd_size, cd_offset, _comment = _END.unpack_from(view, end)
    cd_end = end
    locator = end - _END64_LOCATOR.size
    if locator >= 0 and bytes(view[locator : locator + 4]) == b"PK\x06\x07":
        end64 = _END64_LOCATOR.unpack_from(view, locator)[2]
        if end64 + _END64.size > locator or bytes(view[end64 : end64 + 4]) != b"PK\x06\x06":
            raise ValueError("its zip64 end record is not where its locator says")
        _, _, _, _, disk, cd_disk, n_disk, n, cd_size, cd_offset = _END64.unpack_from(view, end64)
        cd_end = end64
    if disk or cd_disk or n != n_disk or n > MAX_ZIP_ENTRIES:
        raise ValueError(f"its zip directory spans disks or lists more than {MAX_ZIP_ENTRIES} entries")
    if cd_offset + cd_size != cd_end:
        raise ValueError("its zip directory is not where its end record says")
    pos, unpacked = cd_offset, 0
    for _ in range(n):
        fields = _CENTRAL.unpack_from(view, pos)
        if fields[0] != b"PK\x01\x02":
            raise ValueError("its zip directory holds a damaged record")
        method, packed, size, name_len, extra_len, comment_len, offset = (
            fields[i] for i in (6, 10, 11, 12, 13, 14, 18)
        )
        extra = view[pos + _CENTRAL.size + name_len : pos + _CENTRAL.size + name_len + extra_len]
        if _U32 in (packed, size, offset):
            size, packed = _zip64_sizes(extra, size, packed)
        if method != 0 or packed != size:
            raise ValueError("it holds compressed zip entries")
        unpacked += size
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    if pos != cd_end:
        raise ValueError("its zip directory holds more than its end record lists")
    return unpacked


def _zip64_sizes(extra: memoryview, size: int, packed: int) -> tuple[int, int]:
    """(size, packed) from a record's zip64 extra field: 8-byte values, in that order, for those that are 0xFFFFFFFF."""
    pos = 0
    while pos + 4 <= len(extra):
        field, length = struct.unpack_from("<2H", extra, pos)
        if field == _ZIP64_EXTRA:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            wanted = (size == _U32) + (packed == _U32)
            if len(values) < wanted:
                break
            size = values.pop(0) if size == _U32 else size
            packed = values.pop(0) if packed == _U32 else packed
            return size, packed
        pos += 4 + length
    raise ValueError("its zip directory has a zip64 record without its sizes")


def _first_line(exc: BaseException) -> str:
    return printable((str(exc).splitlines() or [""])[0])[:300]
