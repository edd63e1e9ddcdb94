"""The job of ``bench startup`` written the ways people write it without us, each a whole process of its own.

``python -m bench.jobs bare|lightning '<job JSON>'`` trains the synthetic recipe for the job's epochs and then
evaluates the final model on its eval split, as ``python -m flows.train`` does, and prints one JSON line of marks
(seconds since the interpreter started the script: imports done, model built, training done, evaluation done) and
the mean loss of each epoch:

* ``bare``: a plain PyTorch loop (``bench/plain.py``: the product's seeding and sample order, no checkpoints), so
  its epoch losses equal the product's units' losses (checked by bench/startup.py);
* ``lightning``: PyTorch Lightning with a checkpoint per epoch, ``ModelCheckpoint(save_last=True,
  every_n_epochs=1)`` as in ``bench/peer_lightning.py``; its own shuffling, so its losses are not compared.

Only what such a script would import is imported: torch (and Lightning), the recipe, and for ``bare`` the sampler
that fixes the sample order; never Prefect or the product's flows.
"""

from __future__ import annotations

import time

_T0 = time.time()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from recipes.synthetic import SyntheticRecipe  # noqa: E402

MARKS: dict[str, float] = {}


def _mark(name: str) -> None:
    MARKS[name] = time.time() - _T0


def evaluate(recipe: SyntheticRecipe, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
    """Sample-weighted means of ``recipe.evaluate`` over the eval split (what the product's final evaluation does)."""
    model.eval()
    totals: dict[str, float] = {}
    seen = 0
    with torch.no_grad():
        for batch in DataLoader(recipe.eval_dataset(), batch_size=batch_size):
            n = len(batch["y"])
            for k, v in recipe.evaluate(model, batch).items():
                totals[k] = totals.get(k, 0.0) + v * n
            seen += n
    return {k: v / seen for k, v in totals.items()}


def bare(job: dict) -> list[float]:
    from bench.plain import train_plain

    _mark("imports done")
    steps_per_epoch = job["recipe_args"]["num_samples"] // job["batch"]
    run = train_plain(job["recipe_args"], job["batch"], job["seed"], job["epochs"], steps_per_epoch)
    MARKS["model built"] = MARKS["imports done"] + run.build_seconds
    MARKS["in-loop seconds"] = sum(run.unit_seconds)
    _mark("training done")
    assert run.model is not None
    evaluate(SyntheticRecipe(**job["recipe_args"]), run.model, job["batch"])
    return run.unit_losses


def lightning(job: dict) -> list[float]:
    import logging
    import warnings

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    _mark("imports done")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    recipe = SyntheticRecipe(**job["recipe_args"])
    losses: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = recipe.build_model()
            self.epoch_losses: list[float] = []

        def training_step(self, batch, _):
            loss = recipe.loss(self.net, batch)
            self.epoch_losses.append(float(loss.detach()))
            return loss

        def on_train_epoch_end(self) -> None:
            losses.append(sum(self.epoch_losses) / len(self.epoch_losses))
            self.epoch_losses = []

        def configure_optimizers(self):
            optimizer = recipe.build_optimizer(self.net)
            scheduler = recipe.build_scheduler(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(job["seed"])
    with tempfile.TemporaryDirectory(prefix="lightning-") as folder:
        trainer = pl.Trainer(
            max_epochs=job["epochs"], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True, every_n_epochs=1)],
        )  # fmt: skip
        loader = DataLoader(recipe.train_dataset(), batch_size=job["batch"], shuffle=True)
        module = Module()
        _mark("model built")
        t0 = time.perf_counter()
        trainer.fit(module, loader)
        MARKS["in-loop seconds"] = time.perf_counter() - t0  # checkpoints included: they happen inside fit
        _mark("training done")
        evaluate(recipe, module.net, job["batch"])
    return losses


def main(argv: list[str]) -> int:
    kind, job = argv[0], json.loads(argv[1])
    losses = bare(job) if kind == "bare" else lightning(job)
    _mark("evaluation done")
    print(json.dumps({"marks": MARKS, "losses": losses}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
