"""Training code below the flows. What a recipe with a loop of its own uses is importable from here:

    from training import LoopContext, ResumableBatchSampler, capture_rng_state, restore_rng_state

Imported on first use (PEP 562), so ``import training.config`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.custom_loop import LoopContext
    from training.rng import capture as capture_rng_state
    from training.rng import restore as restore_rng_state
    from training.sampler import ResumableBatchSampler

__all__ = ["LoopContext", "ResumableBatchSampler", "capture_rng_state", "restore_rng_state"]

_EXPORTS = {
    "LoopContext": ("training.custom_loop", "LoopContext"),
    "ResumableBatchSampler": ("training.sampler", "ResumableBatchSampler"),
    "capture_rng_state": ("training.rng", "capture"),
    "restore_rng_state": ("training.rng", "restore"),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'training' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)
