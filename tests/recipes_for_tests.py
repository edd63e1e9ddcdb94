"""Recipes that exist only to let tests observe the product from outside."""

from __future__ import annotations

import gc
import os
import weakref

from recipes.gpt import GPTRecipe
from recipes.synthetic import SyntheticRecipe

BUILT_MODELS: list[weakref.ref] = []
ALIVE_AT_BUILD: list[list[bool]] = []


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
    """Remembers (weakly) every real model it builds, and which of the ones before were still alive when it built
    it (``ALIVE_AT_BUILD``), so a test can see that a failed attempt's was freed before the retry built its own."""

    def build_model(self):
        model = super().build_model()
        if next(model.parameters()).device.type != "meta":  # the pre-flight's shape-only build holds no memory
            gc.collect()
            ALIVE_AT_BUILD.append([ref() is not None for ref in BUILT_MODELS])
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


class MicroBatchRecipe(SyntheticRecipe):
    """Records, per ``loss`` call, the micro-batch's size and whether the previous call's activations were
    already freed (a weak reference to them is dead): gradient accumulation must not hold them."""

    def __init__(self, record_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.record_dir, self._previous = record_dir, None

    def loss(self, model, batch):
        import json

        import torch.nn.functional as F

        freed = self._previous is None or self._previous() is None
        logits = model(batch["x"])
        self._previous = weakref.ref(logits)
        os.makedirs(self.record_dir, exist_ok=True)
        with open(os.path.join(self.record_dir, "micro.jsonl"), "a") as f:
            f.write(json.dumps({"size": len(batch["x"]), "previous_freed": freed}) + "\n")
        return F.cross_entropy(logits, batch["y"])


class ContextRecipe(SyntheticRecipe):
    """A cosine schedule over ``ctx.total_steps`` (no step count in recipe_args); writes what it saw of ctx."""

    def __init__(self, record_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.record_dir = record_dir

    def build_scheduler(self, optimizer):
        import json

        import torch

        ctx = self.ctx
        os.makedirs(self.record_dir, exist_ok=True)
        seen = {k: getattr(ctx, k) for k in ("total_steps", "total_samples", "micro_batch_size", "world_size")}
        seen.update(rank=ctx.rank, global_batch_size=ctx.global_batch_size, precision=ctx.precision, seed=ctx.seed)
        with open(os.path.join(self.record_dir, f"ctx-rank{ctx.rank}.json"), "w") as f:
            json.dump(seen, f)
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ctx.total_steps)


class TwoOptimizerRecipe(SyntheticRecipe):
    """A custom ``train_step``: the last layer has its own Adam (GAN-style, two optimizers); its state is
    the recipe's own ``state_dict`` so that it is checkpointed too."""

    def build_optimizer(self, model):
        import torch

        body = [p for layer in list(model)[:-1] for p in layer.parameters()]
        self.head_optimizer = torch.optim.Adam(list(model)[-1].parameters(), lr=0.01)
        return torch.optim.SGD(body, lr=self.lr, momentum=0.9)

    def train_step(self, ctx, batch):
        ctx.optimizer.zero_grad(set_to_none=True)
        self.head_optimizer.zero_grad(set_to_none=True)
        with ctx.autocast():
            loss = self.loss(ctx.model, batch)
        ctx.backward(loss)
        ctx.step(ctx.optimizer, self.head_optimizer)
        return loss

    def state_dict(self):
        return {"head_optimizer": self.head_optimizer.state_dict()}

    def load_state_dict(self, state):
        self.head_optimizer.load_state_dict(state["head_optimizer"])


class SignalledRecipe(RecordingRecipe):
    """Sends this process a real ``signal_name`` during its ``signal_at_step``-th training step, or at the start of
    its ``signal_in_eval``-th evaluation: a polite termination arriving at a chosen point, through the product's
    real signal handler. Once per run: ``<record_dir>/signalled`` marks it sent, so a relaunch (same arguments, the
    same run) trains on."""

    def __init__(self, signal_at_step: int = 0, signal_in_eval: int = 0, signal_name: str = "SIGTERM", **kwargs):
        super().__init__(**kwargs)
        self.signal_at_step, self.signal_in_eval, self.signal_name = signal_at_step, signal_in_eval, signal_name
        self.steps = self.evaluations = 0

    def _send(self) -> None:
        import signal

        marker = os.path.join(self.record_dir, "signalled")
        if os.path.exists(marker):
            return
        os.makedirs(self.record_dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), getattr(signal, self.signal_name))

    def on_train_batch(self, sample_ids: list[int]) -> None:
        super().on_train_batch(sample_ids)
        self.steps += 1
        if self.steps == self.signal_at_step:
            self._send()

    def eval_dataset(self):
        self.evaluations += 1
        if self.evaluations == self.signal_in_eval:
            self._send()
        return super().eval_dataset()


class PacedRecipe(RecordingRecipe):
    """Trains at a steady pace so that a test can send a signal at a known phase: each step takes at least
    ``step_seconds``, each evaluation batch ``eval_seconds``; ``<record_dir>/phase`` says "step" or "eval" (with the
    process id) while the recipe's code runs."""

    def __init__(self, step_seconds: float = 0.0, eval_seconds: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.step_seconds, self.eval_seconds = step_seconds, eval_seconds

    def _phase(self, name: str) -> None:
        os.makedirs(self.record_dir, exist_ok=True)
        with open(os.path.join(self.record_dir, "phase"), "w") as f:
            f.write(f"{name} {os.getpid()}")

    def on_train_batch(self, sample_ids: list[int]) -> None:
        import time

        super().on_train_batch(sample_ids)
        self._phase("step")
        time.sleep(self.step_seconds)

    def evaluate(self, model, batch) -> dict[str, float]:
        import time

        self._phase("eval")
        time.sleep(self.eval_seconds)
        return super().evaluate(model, batch)


class AdamRecipe(SyntheticRecipe):
    """The synthetic recipe with Adam: a checkpoint written with SGD carries no state it could use."""

    def build_optimizer(self, model):
        import torch

        return torch.optim.Adam(model.parameters(), lr=self.lr)


class TiedHeadRecipe(SyntheticRecipe):
    """A tiny language model whose output layer shares its embedding's weight (``head.weight`` is
    ``wte.weight``), the way Hugging Face ties a causal LM's head: a file holds one key of the pair."""

    def build_model(self):
        import torch
        from torch import nn

        class TinyLM(nn.Module):
            def __init__(self, vocab: int, width: int):
                super().__init__()
                self.wte = nn.Embedding(vocab, width)
                self.head = nn.Linear(width, vocab, bias=False)
                self.head.weight = self.wte.weight

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.wte(x.long().clamp(0, self.wte.num_embeddings - 1)).mean(1))

        return TinyLM(self.in_features, self.hidden)


class ShardRecordingGPT(GPTRecipe):
    """The GPT recipe in streaming mode over token shards whose every token of sample ``g`` is ``g`` (see
    tests/shard_data.py): each step appends ``<position> <ids>`` to ``<record_dir>/read-rank<r>.txt``, the ids read
    from the data itself (not the sampler's), so the tests see what training was fed and where in the run."""

    def __init__(self, record_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.record_dir = record_dir

    def loss(self, model, batch):
        x, _ = batch
        if self.ctx.batch_weight > 0:  # an empty share's zero-weight pass trains nothing
            rank = int(os.environ.get("RANK", "0"))
            os.makedirs(self.record_dir, exist_ok=True)
            with open(os.path.join(self.record_dir, f"read-rank{rank}.txt"), "a") as f:
                f.write(f"{self.ctx.samples_seen} " + " ".join(str(int(i)) for i in x[:, 0]) + "\n")
        return super().loss(model, batch)


class StreamRecipe(SyntheticRecipe):
    """A recipe whose train_dataset() is an IterableDataset (``stateful``: with state_dict/load_state_dict)."""

    def __init__(self, stateful: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.stateful = stateful

    def train_dataset(self):
        import torch.utils.data

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                yield from ()

        class StatefulStream(Stream):
            def state_dict(self):
                return {}

            def load_state_dict(self, state):
                pass

        return StatefulStream() if self.stateful else Stream()


class WorkerPidRecipe(SyntheticRecipe):
    """Appends the pid of the process that loads each sample to ``<record_dir>/pids.txt``: the loader-worker tests
    count the processes that served a run."""

    def __init__(self, record_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.record_dir = record_dir

    def train_dataset(self):
        return _PidRecording(super().train_dataset(), self.record_dir)


class _PidRecording:
    def __init__(self, dataset, record_dir: str):
        self.dataset, self.record_dir = dataset, record_dir

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        os.makedirs(self.record_dir, exist_ok=True)
        with open(os.path.join(self.record_dir, "pids.txt"), "a") as f:
            f.write(f"{os.getpid()}\n")
        return self.dataset[i]


class SteadySyntheticRecipe(SyntheticRecipe):
    """The synthetic recipe (a real eval metric) whose every step takes at least ``step_seconds``: a sweep's trials
    are still training when a test kills or stops them, without any file written per step."""

    def __init__(self, step_seconds: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.step_seconds = step_seconds

    def on_train_batch(self, sample_ids: list[int]) -> None:
        import time

        time.sleep(self.step_seconds)


class SparseBufferRecipe(SyntheticRecipe):
    """The synthetic model with a sparse buffer in its state_dict: host snapshots cannot copy a sparse tensor, so the
    run's checkpoints take the serialized path (checkpointing/commit/snapshots.py ``flatten``'s TypeError)."""

    def build_model(self):
        import torch

        model = super().build_model()
        model.register_buffer("mask", torch.eye(4).to_sparse())
        return model
