"""Bytes <-> objects for checkpoint files, and the one rule that makes loading safe: ``weights_only``.

torch is imported on first use, so that the parts of the package that only read manifests (the
``ls``/``verify`` commands, the flow's planning) start without paying for it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any


class CheckpointError(RuntimeError):
    """Base class for checkpoint problems."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something that only an unsafe (code-running) unpickler could load."""


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
    """``torch.load`` with ``weights_only=True``: tensors and plain containers only, never code."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where} holds objects that only an unsafe unpickler could load; refusing it "
            f"(weights_only=True). If you wrote this file yourself, re-save it with tensors and plain "
            f"containers only. Detail: {str(exc).splitlines()[0]}"
        ) from exc
