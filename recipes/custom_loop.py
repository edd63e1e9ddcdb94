"""A recipe that brings its own training loop (Ray Train's style), on the synthetic task of ``recipes.synthetic``.

The product builds nothing here: ``train_loop`` builds the model and the data, resumes from
``ctx.get_checkpoint()``, and reports every ``report_every`` steps, at the end of each epoch and when the run is
asked to stop (``ctx.should_checkpoint``: a termination signal). It resumes exactly (a retried, preempted or
relaunched run ends with the same weights as an uninterrupted one) because everything that decides the next step
is in the reported state: weights, optimizer, schedule, the counters, the sample position (``ctx.sampler`` seeks
to it, at any number of processes) and the RNG states (dropout draws from them).

It runs unchanged on several processes (``--nproc_per_node 2``): ``ctx.prepare_model`` wraps the model in DDP and
``ctx.sampler`` gives each rank its share of every global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from recipes.synthetic import SyntheticRecipe
from training import LoopContext, capture_rng_state, restore_rng_state


class CustomLoopRecipe:
    def __init__(self, report_every: int = 4, **synthetic_args):
        if report_every < 1:
            raise ValueError(f"report_every={report_every}: use a number of steps >= 1")
        self.report_every = report_every
        self.task = SyntheticRecipe(**synthetic_args)  # the model, data and loss; any code of yours works too

    def train_loop(self, ctx: LoopContext) -> None:
        dataset: Any = self.task.train_dataset()  # a map-style dataset: it has a length
        model = self.task.build_model().to(ctx.device)
        optimizer = self.task.build_optimizer(model)
        scheduler = self.task.build_scheduler(optimizer)
        epoch = sample_in_epoch = step = samples_seen = 0

        checkpoint = ctx.get_checkpoint()  # None on a fresh run; the newest report on a retry or a relaunch
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            epoch, sample_in_epoch = checkpoint["epoch"], checkpoint["sample_in_epoch"]
            step, samples_seen = checkpoint["step"], checkpoint["samples_seen"]
            restore_rng_state(checkpoint["rng"])  # last: building the model above drew from the RNG
        trained = ctx.prepare_model(model)  # DDP with several processes; `model` keeps the unwrapped weights

        while not ctx.should_stop:  # True once a report reached max_duration
            sampler = ctx.sampler(len(dataset), epoch=epoch, start=sample_in_epoch)  # this rank's share
            # Its own generator: a loader without one draws from the global RNG each time it starts.
            loader = DataLoader(dataset, batch_sampler=sampler, generator=torch.Generator().manual_seed(epoch))
            for batch in loader:
                loss = self.update(trained, optimizer, scheduler, batch, ctx)
                n = min(ctx.global_batch_size, len(dataset) - sample_in_epoch)  # this step's samples, all ranks
                step, samples_seen, sample_in_epoch = step + 1, samples_seen + n, sample_in_epoch + n
                if sample_in_epoch == len(dataset):
                    epoch, sample_in_epoch = epoch + 1, 0
                stopping = ctx.should_checkpoint  # asked to stop (SIGTERM): report the state now
                if step % self.report_every and sample_in_epoch and not stopping:
                    continue
                state = {
                    "model": model.state_dict(),  # ["state"]["model"] of state.pt: exports and load_path find it
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "epoch": epoch,
                    "sample_in_epoch": sample_in_epoch,
                    "step": step,
                    "samples_seen": samples_seen,
                    "rng": capture_rng_state(),
                }
                ctx.report({"train_loss": loss}, state=state, epoch=epoch, step=step, samples_seen=samples_seen)
                if ctx.should_stop:
                    break

    def update(self, model, optimizer, scheduler, batch, ctx: LoopContext) -> float:
        """One optimizer step on this rank's share of a global batch; returns its loss."""
        batch = {k: v.to(ctx.device) for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss(model, batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return float(loss.detach())


OwnLoopRecipe = CustomLoopRecipe  # its name before 0.2
