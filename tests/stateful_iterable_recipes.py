"""Recipes whose train_dataset() is a stateful IterableDataset (training/position/iterable.py): a seeded generator whose
state is a counter, sharded by ``ctx.rank``, and a Hugging Face streaming dataset over local JSONL files (augmented, if
asked, with noise from the process's own generators)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from recipes.synthetic import SyntheticRecipe


class CountingStream(torch.utils.data.IterableDataset):
    """Sample n of rank r is drawn from a generator seeded (seed, r, n); the state is n, the next sample's number."""

    def __init__(self, seed: int, rank: int, in_features: int, num_classes: int):
        self.seed, self.rank, self.in_features, self.num_classes = seed, rank, in_features, num_classes
        self.count = 0
        self.teacher = torch.randn(in_features, num_classes, generator=torch.Generator().manual_seed(seed))

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.count)
            x = torch.randn(self.in_features, generator=g)
            self.count += 1
            yield {"x": x, "y": (x @ self.teacher).argmax()}

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


class CountingStreamRecipe(SyntheticRecipe):
    """The synthetic task, fed by one ``CountingStream`` per rank."""

    def train_dataset(self):
        return CountingStream(self.data_seed, self.ctx.rank, self.in_features, self.num_classes)


class JsonStreamRecipe(SyntheticRecipe):
    """The synthetic task read from JSONL files by ``datasets.load_dataset('json', streaming=True)``, sharded by rank."""

    def __init__(self, data_files: list[str], augment: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.data_files, self.augment = data_files, augment

    def train_dataset(self):
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        stream = load_dataset("json", data_files=self.data_files, split="train", streaming=True)
        stream = split_dataset_by_node(stream, rank=self.ctx.rank, world_size=self.ctx.world_size)
        return stream.map(_augmented if self.augment else _tensors)


def _tensors(row: dict) -> dict:
    return {"x": torch.tensor(row["x"], dtype=torch.float32), "y": torch.tensor(row["y"])}


def _augmented(row: dict) -> dict:
    sample = _tensors(row)
    return {**sample, "x": augment(sample["x"])}


def augment(x: torch.Tensor) -> torch.Tensor:
    """Noise from all three of the process's global generators (torch's, Python's ``random``, NumPy's), which no
    stream state holds: a resume that restores any one of them wrongly trains on other inputs."""
    return x + 0.1 * torch.randn(x.shape) + 0.1 * random.gauss(0, 1) + 0.1 * float(np.random.randn())


def write_json_rows(folder: Path, files: int, rows: int, in_features: int = 16) -> list[str]:
    """``files`` JSONL files of ``rows`` rows {"x": in_features floats, "y": a class} each: the JsonStreamRecipe's data."""
    g, paths = torch.Generator().manual_seed(3), []
    for f in range(files):
        path = folder / f"part-{f}.jsonl"
        lines = [{"x": row.tolist(), "y": int(row[:4].argmax())} for row in torch.randn(rows, in_features, generator=g)]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(str(path))
    return paths
