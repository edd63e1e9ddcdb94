"""Training code below the flows. What a recipe with a loop of its own uses is importable from here:

    from training import LoopContext, ResumableBatchSampler, capture_rng_state, restore_rng_state

Imported on first use (PEP 562), so ``import training.config`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.position.sampler import ResumableBatchSampler
    from training.unit.own_loop import LoopContext
    from training.unit.rng import capture as capture_rng_state
    from training.unit.rng import restore as restore_rng_state

__all__ = ["LoopContext", "ResumableBatchSampler", "capture_rng_state", "restore_rng_state"]

_EXPORTS = {
    "LoopContext": ("training.unit.own_loop", "LoopContext"),
    "ResumableBatchSampler": ("training.position.sampler", "ResumableBatchSampler"),
    "capture_rng_state": ("training.unit.rng", "capture"),
    "restore_rng_state": ("training.unit.rng", "restore"),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'training' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)
