"""Every random number generator that decides the next step, captured and restored.

States are stored as tensors and plain lists so that they load with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

np: Any
try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _py_to_plain(random.getstate()), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(_plain_to_py(state["python"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def _py_to_plain(s: tuple) -> list:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _plain_to_py(s: list) -> tuple:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
