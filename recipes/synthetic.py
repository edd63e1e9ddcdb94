"""A synthetic classification task whose model and dataset sizes are arguments (tests, benchmarks).

Samples are a pure function of (seed, sample id), so any process can build the same dataset. Labels come from one
random linear teacher drawn from ``data_seed``; the eval split's inputs are drawn from ``data_seed + 1`` and labelled
by the same teacher, so eval accuracy measures what training learned (with a teacher of its own, the eval split was
another task and scored chance however low the train loss went).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


def _draw(num_samples: int, in_features: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_samples`` inputs, then a teacher, from one generator seeded ``seed`` (the train split's order of draws)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_features, generator=g)
    return x, torch.randn(in_features, num_classes, generator=g)


class _Synthetic(Dataset):
    def __init__(self, x: torch.Tensor, teacher: torch.Tensor):
        self.x = x
        self.y = (x @ teacher).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return {"id": i, "x": self.x[i], "y": self.y[i]}


class SyntheticRecipe:
    def __init__(
        self,
        num_samples: int = 512,
        in_features: int = 16,
        hidden: int = 32,
        num_layers: int = 2,
        num_classes: int = 4,
        lr: float = 0.05,
        data_seed: int = 1234,
        eval_samples: int = 128,
        dropout: float = 0.1,
    ):
        if num_samples < 1 or num_layers < 1:
            raise ValueError(f"num_samples={num_samples}, num_layers={num_layers}: both must be >= 1")
        self.num_samples, self.in_features, self.hidden = num_samples, in_features, hidden
        self.num_layers, self.num_classes, self.lr = num_layers, num_classes, lr
        self.data_seed, self.eval_samples = data_seed, eval_samples
        self.dropout = dropout  # draws from torch's RNG every step: resumes must restore it exactly

    def train_dataset(self) -> Dataset:
        return _Synthetic(*_draw(self.num_samples, self.in_features, self.num_classes, self.data_seed))

    def eval_dataset(self) -> Dataset:
        """Inputs of their own, labelled by the train split's teacher."""
        _, teacher = _draw(self.num_samples, self.in_features, self.num_classes, self.data_seed)
        x, _ = _draw(self.eval_samples, self.in_features, self.num_classes, self.data_seed + 1)
        return _Synthetic(x, teacher)

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.in_features
        for _ in range(self.num_layers - 1):
            layers += [nn.Linear(width, self.hidden), nn.ReLU(), nn.Dropout(self.dropout)]
            width = self.hidden
        layers.append(nn.Linear(width, self.num_classes))
        return nn.Sequential(*layers)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    def build_scheduler(self, optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def evaluate(self, model: nn.Module, batch) -> dict[str, float]:
        logits = model(batch["x"])
        return {
            "loss": float(F.cross_entropy(logits, batch["y"])),
            "accuracy": float((logits.argmax(1) == batch["y"]).float().mean()),
        }


def _warmup(step: int) -> float:
    """Linear warm-up over 20 steps, then constant: a step-based schedule to exercise resumes."""
    return min(1.0, (step + 1) / 20)
