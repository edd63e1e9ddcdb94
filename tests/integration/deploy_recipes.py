"""Recipes that let the deployment tests kill a flow-run process at a chosen point, from inside or outside.

They run in the worker's flow-run processes (the tests put the project on PYTHONPATH), and talk to
the test through files in ``marker_dir``: the test never guesses timing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from recipes.synthetic import SyntheticRecipe

_batches_in_this_process = 0


class PausingRecipe(SyntheticRecipe):
    """The first process to train ``pause_after_batches`` batches writes ``threads`` (torch's intra-op thread
    count there), then ``paused`` (its pid), and waits to be killed. Later processes (a restarted run) see the file
    and train on."""

    def __init__(self, marker_dir: str, pause_after_batches: int, **kwargs):
        super().__init__(**kwargs)
        self.marker = Path(marker_dir) / "paused"
        self.pause_after_batches = pause_after_batches

    def on_train_batch(self, sample_ids: list[int]) -> None:
        global _batches_in_this_process
        _batches_in_this_process += 1
        if _batches_in_this_process == self.pause_after_batches and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            (self.marker.parent / "threads").write_text(str(torch.get_num_threads()))
            self.marker.write_text(str(os.getpid()))
            while True:  # until the test kills this process
                time.sleep(0.5)


class DyingRecipe(SyntheticRecipe):
    """Every process that trains a batch notes its pid in ``<marker_dir>/deaths`` and SIGKILLs itself: a machine
    that dies on every attempt."""

    def __init__(self, marker_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.deaths = Path(marker_dir) / "deaths"

    def on_train_batch(self, sample_ids: list[int]) -> None:
        self.deaths.parent.mkdir(parents=True, exist_ok=True)
        with open(self.deaths, "a") as f:
            f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
