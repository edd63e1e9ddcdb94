"""Where the interop tests put their files: a local folder, memory:// and S3 over HTTP (moto)."""

from __future__ import annotations

import io
import uuid
from typing import Any

import torch

from checkpointing.io.protocols import is_local_fs, open_url

STORES = ["local", "memory", "s3"]


def store_root(kind: str, request, tmp_path) -> tuple[str, dict[str, Any]]:
    """A fresh folder URI on the store ``kind`` and the storage options that reach it."""
    if kind == "local":
        return str(tmp_path / "files"), {}
    if kind == "memory":
        return f"memory://interop-{uuid.uuid4().hex[:12]}", {}
    folder, options = request.getfixturevalue("s3")
    return f"{folder.rsplit('/', 1)[0]}/files", options


def put(uri: str, data: bytes, options: dict[str, Any]) -> None:
    fs, path = open_url(uri, options)
    if is_local_fs(fs):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def get(uri: str, options: dict[str, Any]) -> bytes:
    fs, path = open_url(uri, options)
    return fs.cat_file(path)


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
