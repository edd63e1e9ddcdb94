"""Recipes with a loop of their own that misbehave on purpose (tests only)."""

from __future__ import annotations

from recipes.custom_loop import OwnLoopRecipe
from recipes.ray_port import RayPortRecipe
from training import LoopContext


class FlakyOwnLoopRecipe(OwnLoopRecipe):
    """The example loop, raising in its first attempt right after optimizer step ``fail_at_update`` (0: never):
    a failure of the user's own code, between two reports."""

    def __init__(self, fail_at_update: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.fail_at_update = fail_at_update
        self.updates_this_attempt = 0

    def train_loop(self, ctx: LoopContext) -> None:
        self.updates_this_attempt = 0
        super().train_loop(ctx)

    def update(self, model, optimizer, scheduler, batch, ctx: LoopContext) -> float:
        loss = super().update(model, optimizer, scheduler, batch, ctx)
        self.updates_this_attempt += 1
        if ctx.attempt == 1 and self.updates_this_attempt == self.fail_at_update:
            raise RuntimeError(f"the user's loop failed after update {self.fail_at_update} (attempt 1)")
        return loss


class ShortLoopRecipe:
    """Reports ``num_reports`` times without counters, then returns, whatever max_duration says."""

    def __init__(self, num_reports: int = 2):
        self.num_reports = num_reports

    def train_loop(self, ctx: LoopContext) -> None:
        checkpoint = ctx.get_checkpoint()
        done = checkpoint["reports"] if checkpoint else 0
        for i in range(done, self.num_reports):
            ctx.report({"loss": 1.0 / (i + 1)}, state={"reports": i + 1})


class SignalledLoopRecipe(OwnLoopRecipe):
    """The example loop; sends its own process a real SIGTERM right after optimizer step ``signal_after_update``
    of the run (once: ``<marker_dir>/signalled`` marks it sent)."""

    def __init__(self, signal_after_update: int = 0, marker_dir: str = "", **kwargs):
        super().__init__(**kwargs)
        self.signal_after_update, self.marker_dir = signal_after_update, marker_dir
        self.updates = 0

    def update(self, model, optimizer, scheduler, batch, ctx: LoopContext) -> float:
        import os
        import signal

        loss = super().update(model, optimizer, scheduler, batch, ctx)
        self.updates += 1
        marker = os.path.join(self.marker_dir, "signalled")
        if self.updates == self.signal_after_update and not os.path.exists(marker):
            os.makedirs(self.marker_dir, exist_ok=True)
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
        return loss


class SlowRayPortRecipe(RayPortRecipe):
    """Ray's example, each epoch taking at least ``epoch_seconds``: long enough to kill it mid-run."""

    def __init__(self, epoch_seconds: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.epoch_seconds = epoch_seconds

    def train_epoch(self, model, criterion, optimizer, X, Y) -> float:
        import time

        time.sleep(self.epoch_seconds)
        return super().train_epoch(model, criterion, optimizer, X, Y)


class RankZeroReportRecipe:
    """Ray's habit that this product cannot honour: DDP training, ``ctx.report`` under ``if ctx.rank == 0``. Rank 1
    goes on to its next step (a collective) while rank 0 waits at its report."""

    def __init__(self, timeout: float = 5.0, epochs: int = 50):
        self.timeout, self.epochs = timeout, epochs

    def train_loop(self, ctx: LoopContext) -> None:
        import torch
        from torch import nn

        ctx.report_timeout_seconds = self.timeout
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = ctx.prepare_model(model)
        for epoch in range(self.epochs):
            loss = nn.functional.mse_loss(wrapped(torch.randn(8, 4)), torch.randn(8, 1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if ctx.rank == 0:
                ctx.report({"loss": float(loss)}, state={"model": model.state_dict()}, epoch=epoch + 1)


class RankNoiseRecipe:
    """Each rank draws its own randomness: the global torch RNG seeded by rank (its inputs) and a generator of its
    own kept in ``rank_state`` (its targets); DDP averages the gradients. No hand-written gather anywhere."""

    def __init__(self, epoch_seconds: float = 0.1):
        self.epoch_seconds = epoch_seconds

    def train_loop(self, ctx: LoopContext) -> None:
        import time

        import torch
        from torch import nn

        torch.manual_seed(ctx.seed + 100 * ctx.rank)
        targets = torch.Generator().manual_seed(1000 + ctx.rank)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        epoch = 0
        checkpoint = ctx.get_checkpoint()  # this rank's RNG as it was at its last report, and its rank_state
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            targets.set_state(checkpoint["targets"])
            epoch = checkpoint["epoch"]
        wrapped = ctx.prepare_model(model)
        while not ctx.should_stop:
            time.sleep(self.epoch_seconds)
            x, y = torch.randn(16, 4), torch.randn(16, 1, generator=targets)
            loss = nn.functional.mse_loss(wrapped(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch += 1
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            ctx.report({"loss": float(loss)}, state=state, rank_state={"targets": targets.get_state()}, epoch=epoch)
