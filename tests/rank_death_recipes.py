"""A loop of the user's own whose rank dies for real (tests/integration/test_rank_death.py): ``RankNoiseRecipe``, with
rank ``victim`` SIGKILLing itself right before its report of epoch ``die_at`` — after the step both ranks took, while
the other rank waits for it at that report (a meeting point) — in the first attempt only, or in every attempt."""

from __future__ import annotations

import os
import signal
from typing import Any

from tests.own_loop_recipes import RankNoiseRecipe
from training import LoopContext


class DyingRankRecipe(RankNoiseRecipe):
    def __init__(self, die_at: int, victim: int = 1, always: bool = False, epoch_seconds: float = 0.0):
        super().__init__(epoch_seconds=epoch_seconds)
        self.die_at, self.victim, self.always = die_at, victim, always

    def train_loop(self, ctx: LoopContext) -> None:
        super().train_loop(_Dying(ctx, self))


class _Dying:
    """The loop's context, whose ``report`` kills this rank at the chosen epoch."""

    def __init__(self, ctx: LoopContext, recipe: DyingRankRecipe):
        self._ctx, self._recipe = ctx, recipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def report(self, metrics: Any, **kwargs: Any) -> None:
        r = self._recipe
        if kwargs.get("epoch") == r.die_at and self._ctx.rank == r.victim and (r.always or self._ctx.attempt == 1):
            os.kill(os.getpid(), signal.SIGKILL)
        self._ctx.report(metrics, **kwargs)
