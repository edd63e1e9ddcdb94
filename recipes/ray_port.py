"""Ray Train's checkpointing example (its "Saving and Loading Checkpoints" guide), ported: the same training
function, with ``ray.train`` replaced by this product's run context.

    ray.train.get_checkpoint()                 -> ctx.get_checkpoint()
    train.report({}, checkpoint=Checkpoint.from_dict(d))  -> ctx.report({}, state=d, epoch=...)
    ray.train.torch.prepare_model(model)       -> ctx.prepare_model(model)
    ScalingConfig(num_workers=2)               -> --nproc_per_node 2
    train_loop_config={"num_epochs": 4}        -> --max_duration 4ep

Every rank runs ``train_loop``; ``get_checkpoint()`` returns the same state on each, and each rank's
``report`` commits rank 0's state, as Ray keeps rank 0's checkpoint. One difference: Ray's example draws its toy
data from NumPy's unseeded global generator; here the product seeds it (``seed``), so a relaunch draws the same
data and resumes exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.optim import Adam

from training import LoopContext


class RayPortRecipe:
    def __init__(self, n: int = 100, lr: float = 3e-4):
        self.n, self.lr = n, lr

    def train_loop(self, ctx: LoopContext) -> None:
        # toy dataset, as in Ray's example: X (n, 4), Y (n, 1)
        X = torch.Tensor(np.random.normal(0, 1, size=(self.n, 4)))
        Y = torch.Tensor(np.random.uniform(0, 1, size=(self.n, 1)))
        model = nn.Linear(4, 1)
        criterion = nn.MSELoss()
        optimizer = Adam(model.parameters(), lr=self.lr)
        start_epoch = 0

        checkpoint = ctx.get_checkpoint()
        if checkpoint:
            model.load_state_dict(checkpoint["model_weights"])
            optimizer.load_state_dict(checkpoint["optimizer"])  # (Ray's example leaves the optimizer behind)
            start_epoch = checkpoint["epoch"] + 1

        wrapped = ctx.prepare_model(model)  # DDP on several processes
        X, Y = X.to(ctx.device), Y.to(ctx.device)
        epoch = start_epoch
        while not ctx.should_stop:
            loss = self.train_epoch(wrapped, criterion, optimizer, X, Y)
            state = {"epoch": epoch, "model_weights": model.state_dict(), "optimizer": optimizer.state_dict()}
            ctx.report({"train_loss": loss}, state=state, epoch=epoch + 1, samples_seen=self.n * (epoch + 1))
            epoch += 1

    def train_epoch(self, model, criterion, optimizer, X, Y) -> float:
        """One epoch of Ray's example: the whole toy dataset, one step."""
        y = model.forward(X)
        loss = criterion(y, Y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss.detach())
