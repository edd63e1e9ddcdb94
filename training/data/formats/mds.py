"""MosaicML Streaming's MDS shards (what Composer users train from) as a ``ShardedDataset`` format: sample ``k`` of the
dataset is sample ``k`` of the MDS order (``index.json``'s shards in turn), so the product's data position and windowed
shuffle apply unchanged, exact across kills, global batch size and world size changes.

The public layout is read here rather than through the ``mosaicml-streaming`` package: that package pins NumPy below
the product's, pulls in transformers, torchvision and four clouds' SDKs at import, and decodes ``pkl`` columns with
``pickle.loads`` (code from the data); its own reader exists to resume at a fixed global batch size, which is what
``ShardedDataset`` replaces. The layout is small and stable (version 2):

- ``index.json``: ``{"version": 2, "shards": [...]}``, each shard ``{"format": "mds", "column_names",
  "column_encodings", "column_sizes", "compression": null | "zstd[:level]", "samples", "raw_data": {"basename",
  "bytes"}, "zip_data": null | {"basename", "bytes"}}``;
- a shard (after decompression): ``uint32 n``, ``uint32 offsets[n + 1]`` (absolute), the shard's config as JSON, then
  the samples; a sample is one ``uint32`` size per variable-size column, then the columns' bytes in column order.

Decoded like Streaming decodes them: ``str``, ``int``, ``bytes``, ``json``, ``str_int``/``str_float``/``str_decimal``,
the NumPy scalars ``uint8``..``int64``/``float16``..``float64`` (NumPy scalars), ``ndarray[:dtype[:shape]]`` (arrays),
``jpeg``/``png`` (a PIL image when Pillow is installed, else the bytes). ``pkl`` is refused before training: unpickling
runs code of the data's choosing. Compression: ``zstd`` (``pip install 'resumable-train[mds]'``)."""

from __future__ import annotations

import decimal
import mmap
from typing import IO, Any

import numpy as np

from checkpointing.errors import DamagedFileError
from checkpointing.io.untrusted import parse_json
from training.data.formats.base import ShardFormat, ShardReader, decode_image
from training.data.index import MAX_SHARDS, Shard
from training.exceptions import ConfigError, DataError

INDEX = "index.json"
MAX_INDEX_BYTES = 256 << 20
MAX_COLUMNS = 1024
MAX_CONFIG_BYTES = 1 << 20
SCALARS = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
ENCODINGS = ("bytes", "str", "int", "json", "jpeg", "png", "str_int", "str_float", "str_decimal", "ndarray", *SCALARS)
_NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                   34: "float32", 64: "uint64", 65: "int64", 66: "float64"}  # fmt: skip
_IMAGE_ENCODINGS = ("jpeg", "png")


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ConfigError(
            "format='mds': this dataset's shards are zstd-compressed and need zstandard: "
            "pip install 'resumable-train[mds]' (or zstandard) where the run trains"
        ) from None
    return zstandard


def _column_size(encoding: str) -> int | None:
    """The fixed size in bytes of a column of ``encoding``, None when each sample says (as Streaming computes it)."""
    if encoding == "int":
        return 8
    if encoding in SCALARS:
        return int(np.dtype(encoding).itemsize)
    dtype, shape = _ndarray_args(encoding) if encoding.startswith("ndarray:") else (None, None)
    if dtype is not None and shape is not None:
        return int(np.prod(shape)) * int(np.dtype(dtype).itemsize)
    return None


def _ndarray_args(encoding: str) -> tuple[str | None, tuple[int, ...] | None]:
    args = encoding.split(":")[1:]
    dtype = args[0] if args and args[0] else None
    if dtype is not None and dtype not in _NDARRAY_DTYPES.values():
        raise ValueError(encoding)
    shape = tuple(int(d) for d in args[1].split(",")) if len(args) > 1 else None
    if len(args) > 2 or (shape is not None and (not shape or len(shape) > 63 or min(shape) < 1)):
        raise ValueError(encoding)
    return dtype, shape


def _check_encodings(names: Any, encodings: Any, sizes: Any, where: str) -> None:
    ok = isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
    ok = ok and 0 < len(names) == len(encodings) == len(sizes) <= MAX_COLUMNS
    ok = ok and all(isinstance(n, str) and len(n) < 256 for n in names) and len(set(names)) == len(names)
    if not ok or not all(isinstance(e, str) and len(e) < 256 for e in encodings):
        raise DataError(f"{where}: its columns are not lists of names, encodings and sizes MDSWriter writes")
    for name, encoding, size in zip(names, encodings, sizes, strict=True):
        if encoding == "pkl":
            raise DataError(
                f"{where}: column {name!r} is encoded 'pkl', which only unpickling reads (code from the data runs); "
                f"not read: write that column as 'json', 'bytes' or 'ndarray' instead"
            )
        base = encoding.split(":")[0]
        try:
            if base not in ENCODINGS or (base != "ndarray" and ":" in encoding):
                raise ValueError(encoding)
            expected = _column_size(encoding)
        except ValueError:
            raise DataError(
                f"{where}: column {name!r} has encoding {encoding[:40]!r}, which this reader does not decode (it "
                f"reads {', '.join(ENCODINGS)}); write that column with one of those"
            ) from None
        if size != expected:
            raise DataError(f"{where}: column {name!r} ({encoding}) says size {size!r}, its encoding is {expected}")


def _basename(entry: Any, where: str) -> tuple[str, int] | None:
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("basename"), str) and type(entry.get("bytes")) is int):
        raise DataError(f"{where}: a shard's raw_data/zip_data is not {{basename, bytes}}")
    if entry["bytes"] < 0 or "/" in entry["basename"]:
        raise DataError(f"{where}: a shard's file is {entry['basename']!r} of {entry['bytes']} bytes; not read")
    return entry["basename"], entry["bytes"]


def prepare(ds: Any) -> dict[str, dict[str, Any]]:
    """``index.json``, read bounded and typed: shard file name -> what its reader needs. The shards must be in name
    order (the product's shard order; MDSWriter's ``shard.NNNNN`` names are) and have their listed sizes."""
    where = ds.storage.uri(INDEX)
    try:
        body = parse_json(ds.storage.get(INDEX, max_bytes=MAX_INDEX_BYTES), MAX_INDEX_BYTES, allow_nan=False)
    except FileNotFoundError:
        raise DataError(
            f"{where} is missing: an MDS dataset is a folder that MDSWriter wrote with its index.json"
        ) from None
    except DamagedFileError as exc:
        raise DataError(f"{where}: {exc}; restore the index.json MDSWriter wrote") from None
    rows = body.get("shards") if isinstance(body, dict) and body.get("version") == 2 else None
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_SHARDS:
        raise DataError(f"{where}: not an MDS index of version 2 with a list of shards; restore it")
    meta: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not isinstance(row, dict) or row.get("format") != "mds" or type(row.get("samples")) is not int:
            raise DataError(f"{where}: a shard entry is not an MDS shard (format 'mds' with its samples)")
        _check_encodings(row.get("column_names"), row.get("column_encodings"), row.get("column_sizes"), where)
        raw, zipped = _basename(row.get("raw_data"), where), _basename(row.get("zip_data"), where)
        compression = row.get("compression")
        if raw is None or (compression is None) != (zipped is None):
            raise DataError(f"{where}: a shard entry has no raw_data, or compression and zip_data disagree")
        if compression is not None and (not isinstance(compression, str) or compression.split(":")[0] != "zstd"):
            raise DataError(
                f"{where}: compression {str(compression)[:20]!r} is not read (zstd is); rewrite with compression='zstd'"
            )
        if compression is not None:
            _zstd()  # at construction: a missing dependency is one line before any training
        if not 0 <= row["samples"] <= max(0, raw[1] - 8) // 4:  # a sample takes 4 bytes of offsets at least
            raise DataError(f"{where}: a shard of {raw[1]} bytes declares {row['samples']} samples; restore it")
        stored = zipped or raw
        columns = {k: row[k] for k in ("column_names", "column_encodings", "column_sizes")}
        meta[stored[0]] = {"samples": row["samples"], "bytes": stored[1], "raw_bytes": raw[1],
                           "zstd": compression is not None, "columns": columns}  # fmt: skip
    names = list(meta)
    if names != sorted(names) or len(names) != len(rows):
        raise DataError(
            f"{where}: its shards are not listed once each in name order; not read (sample ids would differ)"
        )
    listed = ds.storage.sizes("")
    for name, entry in meta.items():
        size = listed.get(name)
        if size is not None and size < 0:
            raise DataError(f"{ds.storage.uri(name)} is a link or not a regular file; shards are read only as files")
        if size != entry["bytes"]:
            said = "missing" if size is None else f"{size} bytes"
            raise DataError(f"{where}: shard {name} is {said}, index.json says {entry['bytes']} bytes; restore it")
    return meta


def listed(meta: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """The endings of this dataset's shards: only ``.mds.zstd`` when every shard is compressed, so that the unpacked
    copies StreamingDataset leaves beside them (``shard.NNNNN.mds``) are not taken for shards."""
    return tuple(sorted({".mds.zstd" if entry["zstd"] else ".mds" for entry in meta.values()}))


def count(ds: Any, name: str, size: int) -> int:
    entry = ds.meta.get(name)
    if entry is None:
        raise DataError(f"{ds.storage.uri(name)}: not a shard of {ds.storage.uri(INDEX)}; move it out of the folder")
    return int(entry["samples"])


class MDSReader(ShardReader):
    """One MDS shard: memory-mapped when stored raw, decompressed into memory when zstd (its raw size, from
    index.json, bounded by ``cache_bytes``)."""

    def __init__(self, ds: Any, shard: Shard, local: IO[bytes]):
        super().__init__(ds, shard, local)
        self.entry = ds.meta[shard.name]
        self.data = self._read()
        n = self._u32(0)
        self.check_count(n, "samples in its header")
        head = 4 + 4 * (n + 1)
        if head > len(self.data):
            raise self.damaged(f"its header says {n} samples, more than its {len(self.data)} bytes hold")
        self.offsets = np.frombuffer(self.data, np.uint32, n + 1, 4).astype(np.int64)
        first = int(self.offsets[0])
        if not head <= first <= head + MAX_CONFIG_BYTES or int(self.offsets[-1]) != len(self.data):
            raise self.damaged("its sample offsets are outside the shard")
        if (np.diff(self.offsets) < 0).any():
            raise self.damaged("its sample offsets go backwards")
        try:
            config = parse_json(bytes(self.data[head:first]), MAX_CONFIG_BYTES, allow_nan=False)
        except DamagedFileError as exc:
            raise self.damaged(f"its header's config is not JSON ({exc})") from None
        columns = self.entry["columns"]
        if not isinstance(config, dict) or any(config.get(k) != v for k, v in columns.items()):
            raise self.damaged("its header's columns differ from index.json's")
        self.names, self.encodings = columns["column_names"], columns["column_encodings"]
        self.sizes = columns["column_sizes"]
        self.variable = sum(s is None for s in self.sizes)

    def _read(self) -> Any:
        raw = int(self.entry["raw_bytes"])
        if not self.entry["zstd"]:
            if raw != self.shard.size:
                raise self.damaged(f"{self.shard.size} bytes, index.json says {raw}")
            return mmap.mmap(self.local.fileno(), 0, access=mmap.ACCESS_READ) if raw else b""
        if raw > self.ds.cache_bytes:
            raise DataError(
                f"{self.where()} unpacks to {raw} bytes, more than cache_bytes={self.ds.cache_bytes}; raise "
                f"cache_bytes above the largest shard"
            )
        self.local.seek(0)
        out = bytearray()
        try:  # at most one byte more than index.json says: a shard that unpacks to more stops there
            with _zstd().ZstdDecompressor().stream_reader(self.local, closefd=False) as reader:
                while len(out) <= raw and (chunk := reader.read(raw + 1 - len(out))):
                    out += chunk
        except Exception as exc:
            raise self.damaged(f"not zstd data zstandard reads ({type(exc).__name__})") from None
        data = bytes(out)
        if len(data) != raw:
            raise self.damaged(f"unpacks to {len(data)} bytes or more, index.json says {raw}")
        return data

    def _u32(self, at: int) -> int:
        if at + 4 > len(self.data):
            raise self.damaged("it ends inside its header")
        return int(np.frombuffer(self.data, np.uint32, 1, at)[0])

    def sample(self, k: int) -> dict[str, Any]:
        begin, end = int(self.offsets[k]), int(self.offsets[k + 1])
        if end - begin > self.ds.max_sample_bytes:
            raise DataError(
                f"{self.where()}: sample {k} is {end - begin} bytes, more than max_sample_bytes="
                f"{self.ds.max_sample_bytes}; raise it"
            )
        data = bytes(self.data[begin:end])
        head = 4 * self.variable
        given = iter(np.frombuffer(data, np.uint32, self.variable).tolist()) if head <= len(data) else None
        if given is None:
            raise self.damaged(f"sample {k} ends inside its column sizes")
        sizes = [s if s is not None else next(given) for s in self.sizes]
        if head + sum(sizes) != len(data):
            raise self.damaged(f"sample {k}'s column sizes add up to {head + sum(sizes)} bytes, not its {len(data)}")
        out, at = {}, head
        for name, encoding, size in zip(self.names, self.encodings, sizes, strict=True):
            try:
                out[name] = _decode(encoding, data[at : at + size], self.ds.max_sample_bytes)
            except (ValueError, IndexError, UnicodeDecodeError, DamagedFileError, decimal.DecimalException) as exc:
                raise self.damaged(f"sample {k}, column {name!r} is not {encoding} ({type(exc).__name__})") from None
            at += size
        return out

    def close(self) -> None:
        if isinstance(self.data, mmap.mmap):
            self.data.close()
        super().close()


def _decode(encoding: str, data: bytes, limit: int) -> Any:
    if encoding == "bytes":
        return data
    if encoding == "str":
        return data.decode("utf-8")
    if encoding == "int":
        return int(np.frombuffer(data, np.int64)[0])
    if encoding in SCALARS:
        return np.frombuffer(data, encoding)[0]
    if encoding == "json":
        return parse_json(data, limit)
    if encoding in _IMAGE_ENCODINGS:
        return decode_image(data)
    if encoding == "str_int":
        return int(data.decode("utf-8"))
    if encoding == "str_float":
        return float(data.decode("utf-8"))
    if encoding == "str_decimal":
        return decimal.Decimal(data.decode("utf-8"))
    return _ndarray(encoding, data)


def _ndarray(encoding: str, data: bytes) -> np.ndarray:
    dtype, shape = _ndarray_args(encoding)
    at = 0
    if dtype is None:
        dtype, at = _NDARRAY_DTYPES[data[0]], 1
    if shape is None:
        ndim, code = data[at] >> 2, data[at] & 3
        width = 1 << code
        shape = tuple(np.frombuffer(data, f"<u{width}", ndim, at + 1).tolist())
        at += 1 + ndim * width
    itemsize = np.dtype(dtype).itemsize
    if len(data) - at != int(np.prod(shape, dtype=object)) * itemsize:
        raise ValueError("array bytes differ from its shape")
    return np.frombuffer(data, dtype, offset=at).reshape(shape)


MDS = ShardFormat(extensions=(".mds", ".mds.zstd"), prepare=prepare, count=count, reader=MDSReader, listed=listed)
