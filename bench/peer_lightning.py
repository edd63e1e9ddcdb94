"""Peer: the same model, data, epochs and per-epoch checkpointing in PyTorch Lightning, side by side.

Lightning: ModelCheckpoint(save_last=True, every_n_epochs=1), resume with fit(ckpt_path="last").
Ours: the train flow with save_interval="1ep" on a local folder, resume by running it again.
Alternating, medians. Our Prefect server is already running (a test harness) and the flow's own
start (~1-2 s) is inside our time.
"""

from __future__ import annotations

import tempfile
import time
import uuid

import torch

from bench.common import command_line, isolate_prefect, median, record

ARGS = {"num_samples": 16384, "hidden": 1024, "num_layers": 3, "eval_samples": 32}
GBS, EPOCHS, STOP_AT = 64, 4, 2


def _lightning(epochs_first: int, epochs_total: int) -> float:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from recipes.synthetic import SyntheticRecipe

    recipe = SyntheticRecipe(**ARGS)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = recipe.build_model()

        def training_step(self, batch, _):
            return recipe.loss(self.net, batch)

        def configure_optimizers(self):
            return recipe.build_optimizer(self.net)

    folder = tempfile.mkdtemp(prefix="bench-lightning-")

    def fit(epochs: int, resume: bool) -> float:
        torch.manual_seed(1)
        trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True,
                                                                                     every_n_epochs=1, save_top_k=-1)])
        loader = DataLoader(recipe.train_dataset(), batch_size=GBS, shuffle=True)
        t0 = time.perf_counter()
        trainer.fit(Module(), loader, ckpt_path="last" if resume else None)
        return time.perf_counter() - t0

    first = fit(epochs_first, resume=False)
    return first + (fit(epochs_total, resume=True) if epochs_total > epochs_first else 0.0)


def _ours(epochs_first: int, epochs_total: int) -> float:
    from flows.train import TrainConfig, train
    from training.session import forget_warm_state

    common = dict(run_name=f"p{uuid.uuid4().hex[:8]}", save_folder=tempfile.mkdtemp(prefix="bench-ours-"),
                  recipe="recipes.synthetic:SyntheticRecipe", recipe_args=ARGS, save_interval="1ep",
                  global_batch_size=GBS, seed=1, log_every_n_steps=10**9)
    forget_warm_state()
    t0 = time.perf_counter()
    train(TrainConfig(max_duration=f"{epochs_first}ep", **common))
    if epochs_total > epochs_first:
        forget_warm_state()  # a resume is a new process: nothing in memory
        train(TrainConfig(max_duration=f"{epochs_total}ep", **common))
    return time.perf_counter() - t0


def run(reps: int = 3) -> None:
    isolate_prefect()
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from prefect.testing.utilities import prefect_test_harness

    times: dict[str, list[float]] = {}
    with prefect_test_harness(server_startup_timeout=180):
        _ours(1, 1), _lightning(1, 1)  # warm-up of both
        for _ in range(reps):
            for name, fn, args in [("ours, full run", _ours, (EPOCHS, EPOCHS)),
                                   ("Lightning, full run", _lightning, (EPOCHS, EPOCHS)),
                                   ("ours, stop + resume", _ours, (STOP_AT, EPOCHS)),
                                   ("Lightning, stop + resume", _lightning, (STOP_AT, EPOCHS))]:
                times.setdefault(name, []).append(fn(*args))
    m = {k: median(v) for k, v in times.items()}
    lines = [f"{ARGS['num_samples']} samples, {EPOCHS} epochs, batch {GBS}, model hidden {ARGS['hidden']} x "
             f"{ARGS['num_layers']} layers, a checkpoint per epoch; stop + resume = {STOP_AT} epochs, then a second "
             f"run to {EPOCHS}. {reps} alternating repetitions, medians.", "",
             "| | ours s | Lightning s | ours / Lightning (goal <= 1.0) |", "| --- | --- | --- | --- |",
             f"| full run | {m['ours, full run']:.1f} | {m['Lightning, full run']:.1f} | "
             f"{m['ours, full run'] / m['Lightning, full run']:.2f} |",
             f"| stop + resume | {m['ours, stop + resume']:.1f} | {m['Lightning, stop + resume']:.1f} | "
             f"{m['ours, stop + resume'] / m['Lightning, stop + resume']:.2f} |",
             "", "Not counted: Prefect's ephemeral server start (9-17 s here) when `python -m flows.train` runs "
                 "without a server; Lightning's import (~3 s)."]
    record("Peer: PyTorch Lightning (goal: ours / Lightning <= 1.0)", command_line(), lines)
