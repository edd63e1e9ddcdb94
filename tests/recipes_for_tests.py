"""Recipes that exist only to let tests observe the product from outside."""

from __future__ import annotations

import weakref

from recipes.synthetic import SyntheticRecipe

BUILT_MODELS: list[weakref.ref] = []


class TrackingRecipe(SyntheticRecipe):
    """Remembers (weakly) every model it builds, so a test can see that a failed attempt's is freed."""

    def build_model(self):
        model = super().build_model()
        BUILT_MODELS.append(weakref.ref(model))
        return model


_steps_in_this_process = 0


class GatedRecipe(SyntheticRecipe):
    """Blocks before training step ``gate_at_step`` (counted in this process) while ``gate_file`` exists,
    so a test can hold a writer at a known point without guessing at timings."""

    def __init__(self, gate_file: str = "", gate_at_step: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.gate_file, self.gate_at_step = gate_file, gate_at_step

    def on_train_batch(self, sample_ids):
        global _steps_in_this_process
        _steps_in_this_process += 1
        if _steps_in_this_process == self.gate_at_step:
            import os
            import time

            while os.path.exists(self.gate_file):
                time.sleep(0.01)
        super().on_train_batch(sample_ids)
