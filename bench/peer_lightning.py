"""Peer: the same model, data, epochs and per-epoch checkpoints in PyTorch Lightning, side by side.

Lightning: ``ModelCheckpoint(save_last=True, every_n_epochs=1)``; resume: a new Trainer, ``fit(ckpt_path="last")``.
Ours: the train flow with ``save_interval="1ep"`` on a local folder; resume: the flow run again (cold: the
in-memory state is dropped, as in a new process). Both in this process, alternating, medians; the wall time
runs from building the trainer (or calling the flow) to the end of training.

Our Prefect server is already running (``prefect_test_harness``, started once) and the flow's own start is
inside our time. What a process without a server pays on top (the ephemeral server) is measured apart, in
fresh processes, and added for the "with server start" ratios: once per process, so twice for a resume.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
import warnings

import torch

from bench.common import isolate_prefect, load_average, median, parser, progress, record, rotated, scratch, spread
from bench.plain import parameter_bytes

RECIPE = "recipes.synthetic:SyntheticRecipe"
_NOOP_FLOW = """
import time
t0 = time.time()
from prefect import flow
@flow
def noop():
    return 1
t1 = time.time()
noop()
print(time.time() - t1)
"""


def lightning_run(args: dict, batch: int, epochs_first: int, epochs_total: int) -> float:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from recipes.synthetic import SyntheticRecipe

    recipe = SyntheticRecipe(**args)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = recipe.build_model()

        def training_step(self, batch, _):
            return recipe.loss(self.net, batch)

        def configure_optimizers(self):
            optimizer = recipe.build_optimizer(self.net)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": recipe.build_scheduler(optimizer), "interval": "step"},
            }

    folder = scratch("lightning-")

    def fit(epochs: int, resume: bool) -> None:
        torch.manual_seed(1)
        trainer = pl.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=folder, save_last=True, every_n_epochs=1)],
        )
        loader = DataLoader(recipe.train_dataset(), batch_size=batch, shuffle=True)
        trainer.fit(Module(), loader, ckpt_path="last" if resume else None)

    t0 = time.perf_counter()
    fit(epochs_first, resume=False)
    if epochs_total > epochs_first:
        fit(epochs_total, resume=True)
    return time.perf_counter() - t0


def our_run(args: dict, batch: int, epochs_first: int, epochs_total: int) -> float:
    from flows.train import TrainConfig, train
    from training.unit.warm import PROCESS

    common = dict(
        run_name=f"p{uuid.uuid4().hex[:8]}",
        save_folder=scratch("ours-"),
        recipe=RECIPE,
        recipe_args=args,
        save_interval="1ep",
        global_batch_size=batch,
        seed=1,
    )
    PROCESS.forget()
    t0 = time.perf_counter()
    train(TrainConfig(max_duration=f"{epochs_first}ep", **common))
    if epochs_total > epochs_first:
        PROCESS.forget()  # a resume is a new process: nothing in memory
        train(TrainConfig(max_duration=f"{epochs_total}ep", **common))
    return time.perf_counter() - t0


def server_start_seconds(api_url: str, reps: int = 2) -> tuple[float, float, float]:
    """A no-op flow called in a fresh process, without a server (ephemeral) and with one: (ephemeral, with, diff)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    times: dict[str, list[float]] = {"ephemeral": [], "server": []}
    for rep in range(reps):
        for mode in rotated(["ephemeral", "server"], rep):
            e = env if mode == "ephemeral" else {**env, "PREFECT_API_URL": api_url}
            out = subprocess.run(
                [sys.executable, "-c", _NOOP_FLOW], env=e, capture_output=True, text=True, timeout=300, check=True
            ).stdout
            times[mode].append(float(out.strip().splitlines()[-1]))
    eph, srv = median(times["ephemeral"]), median(times["server"])
    return eph, srv, eph - srv


def main(argv: list[str]) -> None:
    p = parser("peer", "Ours vs PyTorch Lightning: full run and stop + resume, same model, data, epochs, checkpoints.")
    p.add_argument("--hidden", type=int, default=3584, help="width of the synthetic MLP (sets the checkpoint size)")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthetic MLP")
    p.add_argument("--samples", type=int, default=256, help="samples per epoch")
    p.add_argument("--batch", type=int, default=32, help="batch size")
    p.add_argument("--epochs", type=int, default=4, help="epochs of the full run")
    p.add_argument("--stop-at", type=int, default=2, help="epochs before the stop, in stop + resume")
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions, medians reported")
    a = p.parse_args(argv)
    load = load_average()
    isolate_prefect()
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    warnings.filterwarnings("ignore", module="lightning_fabric")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    args = {"num_samples": a.samples, "hidden": a.hidden, "num_layers": a.layers, "eval_samples": 32}
    variants = [
        ("ours", "full", our_run, (a.epochs, a.epochs)),
        ("Lightning", "full", lightning_run, (a.epochs, a.epochs)),
        ("ours", "resume", our_run, (a.stop_at, a.epochs)),
        ("Lightning", "resume", lightning_run, (a.stop_at, a.epochs)),
    ]
    times: dict[tuple[str, str], list[float]] = {}
    with prefect_test_harness(server_startup_timeout=180):
        small = {**args, "hidden": 8}
        our_run(small, a.batch, 1, 2), lightning_run(small, a.batch, 1, 2)  # warm-up of both (first-call costs)
        for rep in range(a.reps):
            for who, what, fn, epochs in rotated(variants, rep):
                times.setdefault((who, what), []).append(fn(args, a.batch, *epochs))
                progress(f"rep {rep} {who} {what}: {times[(who, what)][-1]:.1f} s")
        ephemeral, with_server, server = server_start_seconds(PREFECT_API_URL.value())
    _report(a, times, ephemeral, with_server, server, load)


def _report(a, times, ephemeral: float, with_server: float, server: float, load: str) -> None:
    mb = 2 * parameter_bytes({"hidden": a.hidden, "num_layers": a.layers}) / 1e6
    lines = [
        f"Synthetic MLP hidden {a.hidden} x {a.layers} (checkpoint ~{mb:.0f} MB with SGD momentum), "
        f"{a.samples} samples, batch {a.batch}, {a.epochs} epochs, a checkpoint per epoch to a local folder; "
        f"stop + resume = {a.stop_at} epochs, then a new run (ours: a new flow run, cold; Lightning: a new "
        f"Trainer with ckpt_path='last') to {a.epochs}. {a.reps} alternating repetitions, medians (min-max).",
        "",
        "| | ours s | Lightning s | ours / Lightning, server running (goal <= 1.0) "
        "| ours / Lightning, with server start |",
        "| --- | --- | --- | --- | --- |",
    ]
    for what, label, starts in [("full", "full run", 1), ("resume", "stop + resume", 2)]:
        ours, peer = times[("ours", what)], times[("Lightning", what)]
        r = median(ours) / median(peer)
        r_start = (median(ours) + starts * server) / median(peer)
        lines.append(
            f"| {label} | {spread(ours, '{:.1f}')} | {spread(peer, '{:.1f}')} | {r:.2f} "
            f"({'met' if r <= 1 else 'missed'}) | {r_start:.2f} ({'met' if r_start <= 1 else 'missed'}) |"
        )
    lines += [
        "",
        f"Server start: a no-op flow in a fresh process takes {ephemeral:.1f} s without a server "
        f"(`python -m flows.train` starts an ephemeral one) and {with_server:.1f} s against a running "
        f"server: {server:.1f} s per process, added once for a full run and twice for stop + resume. "
        "Imports are in neither column (both sides run in this process).",
        "",
        "Lightning as configured (`save_last=True`, not `'link'`) writes each epoch's checkpoint twice, the "
        "top-k file and last.ckpt; ours writes it once.",
    ]
    record("Peer: PyTorch Lightning (goal: ours / Lightning <= 1.0)", lines, load)
