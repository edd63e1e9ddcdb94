"""WebDataset tar shards as a ``ShardedDataset`` format: random access by sample, so the product's data position
applies (exact across kills, global batch size and world size changes), where ``webdataset.WebDataset`` only streams.

A tar has no index of its samples: one read of each tar's headers (``tarfile``, seeking over the members' data) finds
every member's offset and size; the index's sample count comes from the same read. Members are grouped into samples
as WebDataset groups them: consecutive members sharing a key (the member's path up to the first dot of its basename)
form one sample, ``{"__key__": key, <rest of the name, lower case>: value}``; ``__*__`` files at the top level are
WebDataset's metadata and skipped, folders skipped. Values are bytes, decoded by their last extension the way
WebDataset's default handlers do: ``txt``/``text`` str, ``cls``/``cls2``/``index``/``id`` int, ``json``/``jsn``
JSON, ``npy`` an array (no pickles), images (``jpg``, ``png``, ...) a PIL image when Pillow is installed. ``pyd``,
``pickle`` and ``pth`` stay bytes (unpickling runs code from the data).

Untrusted like any shard: a member that is a link or a device, a member past the end of the file, a name used twice in
one sample, a sample larger than ``max_sample_bytes`` or a tar ``tarfile`` cannot read is one DataError naming the
shard."""

from __future__ import annotations

import io
import re
import tarfile
from typing import IO, Any

import numpy as np

from checkpointing.errors import DamagedFileError
from checkpointing.io.untrusted import parse_json
from training.data.formats.base import ShardFormat, ShardReader, decode_image
from training.data.index import Shard
from training.exceptions import DataError

MAX_MEMBERS = 10_000_000  # per shard
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext: (key, extensions)
_IMAGES = {"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "bmp", "webp", "tif", "tiff", "gif"}
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's skip_meta
_INTS = {"cls", "cls2", "class", "count", "index", "inx", "id"}
_TEXT = {"txt", "text", "transcript"}


class TarIndex:
    """A tar's samples: member ``m`` is ``offsets[m]``, ``sizes[m]`` bytes, named ``suffixes[m]``; sample ``k`` is
    members ``first[k]:first[k + 1]`` under key ``keys[k]``."""

    def __init__(self, local: IO[bytes], size: int, where: str, limit: int):
        keys: list[str] = []
        first: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        suffixes: list[str] = []
        local.seek(0)
        try:
            with tarfile.open(fileobj=local, mode="r:") as tar:
                for n, member in enumerate(_members(tar)):
                    if n >= MAX_MEMBERS:
                        raise DataError(f"{where}: more than {MAX_MEMBERS} members; split the shard")
                    if member.issym() or member.islnk():
                        raise DataError(f"{where}: member {member.name[:200]!r} is a link; a shard holds files only")
                    if member.isdir():
                        continue
                    if not member.isreg():
                        raise DataError(
                            f"{where}: member {member.name[:200]!r} is not a file; a shard holds files only"
                        )
                    if member.offset_data + member.size > size:
                        raise DataError(f"{where}: member {member.name[:200]!r} runs past the end; restore the shard")
                    if _META.match(member.name):
                        continue  # WebDataset's metadata files
                    match = _KEY.match(member.name)
                    if match is None:
                        continue  # WebDataset skips a name with no extension
                    key, suffix = match.group(1), match.group(2).lower()
                    if not keys or keys[-1] != key:
                        keys.append(key)
                        first.append(len(offsets))
                    elif suffix in suffixes[first[-1] :]:
                        raise DataError(f"{where}: sample {key[:200]!r} has two members named {suffix!r}")
                    if member.size > limit:
                        raise DataError(
                            f"{where}: member {member.name[:200]!r} is {member.size} bytes, more than "
                            f"max_sample_bytes={limit}; raise it"
                        )
                    offsets.append(member.offset_data)
                    sizes.append(member.size)
                    suffixes.append(suffix)
        except (tarfile.TarError, EOFError, OSError, UnicodeError) as exc:
            raise DataError(
                f"{where}: not a tar file tarfile reads ({type(exc).__name__}); restore the shard"
            ) from None
        self.keys, self.suffixes = keys, suffixes
        self.first = np.asarray([*first, len(offsets)], np.int64)
        self.offsets, self.sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)


def _members(tar: tarfile.TarFile) -> Any:
    """The members, one header at a time (``tar.next()``), without the TarFile keeping every one."""
    while (member := tar.next()) is not None:
        yield member
        tar.members.clear()  # type: ignore[attr-defined]  # the list TarFile keeps of what it read


def count(ds: Any, name: str, size: int) -> int:
    """The tar's samples, read where it lies (its headers only, seeking over the data), for an index being built."""
    with ds.storage.open_read(name) as f:
        return len(TarIndex(f, size, ds.storage.uri(name), ds.max_sample_bytes).keys)


class TarReader(ShardReader):
    def __init__(self, ds: Any, shard: Shard, local: IO[bytes]):
        super().__init__(ds, shard, local)
        self.index = TarIndex(local, shard.size, self.where(), ds.max_sample_bytes)
        self.check_count(len(self.index.keys), "samples")

    def sample(self, k: int) -> dict[str, Any]:
        index = self.index
        a, b = int(index.first[k]), int(index.first[k + 1])
        total = int(index.sizes[a:b].sum())
        if total > self.ds.max_sample_bytes:
            raise DataError(
                f"{self.where()}: sample {k} is {total} bytes, more than max_sample_bytes={self.ds.max_sample_bytes}; "
                f"raise it"
            )
        out: dict[str, Any] = {"__key__": index.keys[k]}
        for m in range(a, b):
            self.local.seek(int(index.offsets[m]))
            data = self.local.read(int(index.sizes[m]))
            if len(data) != int(index.sizes[m]):
                raise self.damaged(f"member {index.keys[k]}.{index.suffixes[m]} was cut short")
            try:
                out[index.suffixes[m]] = decode(index.suffixes[m], data, self.ds.max_sample_bytes)
            except (ValueError, UnicodeDecodeError, DamagedFileError) as exc:
                raise self.damaged(
                    f"member {index.keys[k]}.{index.suffixes[m]} does not decode ({type(exc).__name__})"
                ) from None
        return out


def decode(suffix: str, data: bytes, limit: int) -> Any:
    """A member's value by its last extension, as WebDataset's default decoders give it; unknown ones stay bytes."""
    ext = suffix.rsplit(".", 1)[-1]
    if ext in _TEXT:
        return data.decode("utf-8")
    if ext in _INTS:
        return int(data.decode("utf-8"))
    if ext in ("json", "jsn"):
        return parse_json(data, limit)
    if ext == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    if ext in _IMAGES:
        return decode_image(data)
    return data


WEBDATASET = ShardFormat(extensions=(".tar",), count=count, reader=TarReader)
