"""Recipes that exist only to let tests observe the product from outside."""

from __future__ import annotations

import os
import weakref

from recipes.synthetic import SyntheticRecipe

BUILT_MODELS: list[weakref.ref] = []


class RecordingRecipe(SyntheticRecipe):
    """Appends every sample id trained on (as the product reports it) to ``<record_dir>/ids-rank<r>.txt``: the
    sample-accounting tests read it to prove nothing was repeated or dropped. A test-only recipe, because a
    recipe argument that names a file to write is not something a worker should accept from any run."""

    def __init__(self, record_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.record_dir = record_dir

    def on_train_batch(self, sample_ids: list[int]) -> None:
        rank = int(os.environ.get("RANK", "0"))
        os.makedirs(self.record_dir, exist_ok=True)
        with open(os.path.join(self.record_dir, f"ids-rank{rank}.txt"), "a") as f:
            f.write(" ".join(str(int(i)) for i in sample_ids) + "\n")


class TrackingRecipe(SyntheticRecipe):
    """Remembers (weakly) every real model it builds, so a test can see that a failed attempt's is freed."""

    def build_model(self):
        model = super().build_model()
        if next(model.parameters()).device.type != "meta":  # the pre-flight's shape-only build holds no memory
            BUILT_MODELS.append(weakref.ref(model))
        return model


_steps_in_this_process = 0


class GatedRecipe(RecordingRecipe):
    """Blocks before training step ``gate_at_step`` (counted in this process) while ``gate_file`` exists,
    so a test can hold a writer at a known point without guessing at timings."""

    def __init__(self, gate_file: str = "", gate_at_step: int = 0, record_dir: str = "", **kwargs):
        super().__init__(record_dir=record_dir, **kwargs)
        self.gate_file, self.gate_at_step = gate_file, gate_at_step

    def on_train_batch(self, sample_ids):
        global _steps_in_this_process
        _steps_in_this_process += 1
        if _steps_in_this_process == self.gate_at_step:
            import time

            while os.path.exists(self.gate_file):
                time.sleep(0.01)
        if self.record_dir:
            super().on_train_batch(sample_ids)
