"""The samples of the MDS and WebDataset tests, a function of the sample's id ``g`` alone: the tests write them with
the formats' own writers (tests/fixtures/mds/make_fixture.py, ``webdataset.ShardWriter``) and read every one back
equal; the ``tokens`` column (every token ``g``) lets a training run record which samples it was fed."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 8
MDS_FIXTURES = Path(__file__).parent / "fixtures" / "mds"
MDS_SAMPLES = 276  # tests/fixtures/mds/zstd: the same total as tests/shard_data.py's token shards
MDS_RAW_SAMPLES = 30  # tests/fixtures/mds/raw (uncompressed)
MDS_COLUMNS = {"id": "int", "tokens": "ndarray:uint16:9", "arr": "ndarray", "text": "str", "raw": "bytes",
               "meta": "json", "f32": "float32", "u8": "uint8", "i16": "int16", "img": "png", "photo": "jpeg"}  # fmt: skip


def image(g: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.full((4, 3, 3), g % 251, np.uint8))


def mds_sample(g: int) -> dict[str, Any]:
    return {
        "id": g,
        "tokens": np.full(BLOCK + 1, g, np.uint16),
        "arr": np.arange(g % 5 + 1, dtype=np.float32 if g % 2 else np.int64).reshape(1, -1) * g,
        "text": f"sample {g} é",
        "raw": bytes([g % 256]) * (g % 7),
        "meta": {"g": g, "odd": bool(g % 2), "list": [g, str(g)]},
        "f32": np.float32(g / 4),
        "u8": np.uint8(g % 256),
        "i16": np.int16(-g),
        "img": image(g),
        "photo": image(g),
    }


def wds_sample(g: int) -> dict[str, Any]:
    """What ``webdataset.ShardWriter`` is given for sample ``g`` (its encoders turn each value into bytes)."""
    return {
        "__key__": f"s{g:06d}",
        "tokens.npy": np.full(BLOCK + 1, g, np.uint16),
        "txt": f"sample {g} é",
        "cls": g % 10,
        "json": {"g": g, "list": [g, str(g)]},
        "png": image(g),
        "bin": bytes([g % 256]) * (g % 7),
    }


def write_wds(folder: Path, n: int, per_shard: int = 45) -> None:
    """``n`` samples in tars of ``per_shard`` by the real ``webdataset.ShardWriter`` (the last tar shorter)."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "part-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for g in range(n):
            sink.write(wds_sample(g))


def plain(value: Any) -> Any:
    """A decoded value in a form == compares: images as (mode, size, pixels), arrays as (dtype, shape, list)."""
    if hasattr(value, "getdata") and hasattr(value, "mode"):
        return ("image", value.mode, value.size, np.asarray(value).tolist())
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tolist())
    if isinstance(value, np.generic):
        return ("scalar", str(value.dtype), value.item())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k not in ("__url__", "__local_path__")}
    return value


def tar_bytes(members: list[tuple[str, bytes | None, str]]) -> bytes:
    """A tar of (name, data, kind) members, kind 'file', 'symlink' or 'dir': hostile shards for the tests."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return out.getvalue()
