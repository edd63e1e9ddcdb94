"""What a unit saves and restores, listed once (torchtitan keeps one dict of ``Stateful`` objects; DCP's
``Stateful`` protocol is two methods).

``state.pt`` holds ``{"state": TrainState.state_dict(), "progress": ...}`` (Composer's layout: the weights are
at ``["state"]["model"]``); a sharded checkpoint holds model and optimizer as DCP shards and the other parts in
``extra.pt``. Either way the parts are named here, and saving and loading walk the same list, so a part added
to one cannot be forgotten by the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from training.recipe.hooks import Hooks

PARTS = ("model", "optimizer", "scheduler", "scaler", "recipe")
SHARDED = ("model", "optimizer")  # what DCP writes as shards under parallelism='fsdp'
SMALL = ("scheduler", "scaler", "recipe")  # the rest: small, saved whole


@dataclass
class TrainState:
    """The stateful parts of a unit: model (unwrapped), optimizer, LR scheduler, fp16 scaler, the recipe's own."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    hooks: Hooks

    def state_dict(self, parts: Iterable[str] = PARTS) -> dict[str, Any]:
        """The state of ``parts`` (None for a part this run does not have)."""
        return {name: self._get(name) for name in parts}

    def load_state_dict(self, state: dict[str, Any], parts: Iterable[str] = PARTS) -> None:
        """Loads ``parts`` from ``state``; a part the checkpoint does not hold (None) keeps its fresh state."""
        for name in parts:
            if state.get(name) is not None:
                self._set(name, state[name])

    def _get(self, name: str) -> Any:
        if name == "recipe":
            return self.hooks.state_dict() if self.hooks.state_dict is not None else None
        part = getattr(self, name)
        return part.state_dict() if part is not None else None

    def _set(self, name: str, value: Any) -> None:
        if name == "recipe":
            if self.hooks.load_state_dict is not None:
                self.hooks.load_state_dict(value)
            return
        part = getattr(self, name)
        if part is not None:
            part.load_state_dict(value)
