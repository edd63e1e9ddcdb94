"""A character-level GPT trained the way nanoGPT's ``train.py`` trains its shakespeare_char model, as a recipe.

The model is a decoder-only transformer (pre-LayerNorm blocks of causal self-attention and a GELU MLP,
learned positions, the output head tied to the token embedding) written for this recipe; the training
choices are nanoGPT's: AdamW with weight decay on every weight of two or more dimensions and none on
LayerNorm weights or biases, linear warm-up then cosine decay to ``min_lr``, and it is meant to be run with
``grad_clip_norm=1.0``, ``grad_accumulation>1`` and ``precision=bf16``. docs/porting-nanogpt.md maps every
option of nanoGPT's script to ours and lists where the port did not fit.

Data: the first 63,889 characters of Shakespeare's *Coriolanus* (public domain), shipped as
``recipes/data/coriolanus.txt``; no download. The vocabulary is the text's sorted characters and the first
90 % is the training split, as nanoGPT's ``data/shakespeare_char/prepare.py`` does. Training sample ``i``
is the block of ``block_size`` characters starting at offset ``i * stride`` (its targets are the same block
shifted by one): the sample id is the offset, so the product's sampler owns the data position.

Streaming mode (``recipe_args={"data_url": "s3://bucket/tokens/", "vocab_size": 50304}``): token shards as nanoGPT's
``prepare.py`` writes them (``.bin`` uint16, or ``.npy``), in a folder or a bucket, read through
``training.data.ShardedDataset``; sample ``k`` is the ``k``-th non-overlapping block of a shard (docs/data-position.md).
``data_options`` are the store's fsspec options (an endpoint; credentials come from the environment, never here); a
deployment run refuses them and any ``data_url``/``val_url`` outside the worker's ``TRAIN_ALLOWED_ROOTS``: its data's
options are the worker's ``TRAIN_DATA_STORAGE_OPTIONS`` (training/config/trust.py, training/data/dataset.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from checkpointing.io.redact import credential_keys  # one word list for every credential check and redaction
from training.config import ConfigError

CORPUS = Path(__file__).with_name("data") / "coriolanus.txt"


# -- data -------------------------------------------------------------------------------------------
class Blocks(Dataset):
    """Block ``i``: (x, y) = characters ``[i*stride, i*stride + block_size)`` and the same shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int):
        if len(tokens) <= block_size:
            raise ValueError(f"block_size={block_size}: the split has only {len(tokens)} characters")
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def read_corpus() -> tuple[str, str, str]:
    """(the text, its vocabulary: sorted distinct characters, the sha256 of its bytes)."""
    data = CORPUS.read_bytes()
    text = data.decode("utf-8")
    return text, "".join(sorted(set(text))), hashlib.sha256(data).hexdigest()


# -- model ------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (h.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for h in self.qkv(x).split(c, dim=2))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm and a head tied to the embedding."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float, bias: bool
    ):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as GPT-2 and nanoGPT do
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def warmup_cosine(lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> Callable[[int], float]:
    """nanoGPT's ``get_lr(it)``: linear warm-up over ``warmup_steps``, cosine from ``lr`` to ``min_lr`` at
    step ``decay_steps``, then ``min_lr``. Returns the learning rate of optimizer step ``it`` (0-based)."""

    def lr_at(it: int) -> float:
        if it < warmup_steps:
            return lr * (it + 1) / (warmup_steps + 1)
        if it >= decay_steps:
            return min_lr
        coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_steps) / (decay_steps - warmup_steps)))
        return min_lr + coeff * (lr - min_lr)

    return lr_at


# -- recipe -----------------------------------------------------------------------------------------
class GPTRecipe:
    """nanoGPT's shakespeare_char run, scaled down to train a few hundred steps on two CPU cores.

    nanoGPT's own shakespeare_char sizes: ``{"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256,
    "dropout": 0.2}`` with ``global_batch_size=64`` (see docs/porting-nanogpt.md)."""

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 64,
        dropout: float = 0.1,
        bias: bool = False,
        lr: float = 1e-3,
        min_lr: float = 1e-4,
        warmup_steps: int = 10,
        lr_decay_steps: int | None = None,
        decay_lr: bool = True,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.99,
        stride: int = 1,
        val_fraction: float = 0.1,
        compile: bool = False,
        data_url: str | None = None,
        val_url: str | None = None,
        vocab_size: int | None = None,
        data_options: dict[str, Any] | None = None,
    ):
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        if min(n_layer, n_head, block_size, stride) < 1 or warmup_steps < 0:
            raise ValueError("n_layer, n_head, block_size and stride must be >= 1 and warmup_steps >= 0")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction}: use a fraction between 0 and 1")
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        self.dropout, self.bias = dropout, bias
        self.lr, self.min_lr, self.warmup_steps, self.lr_decay_steps = lr, min_lr, warmup_steps, lr_decay_steps
        self.decay_lr, self.weight_decay, self.betas = decay_lr, weight_decay, (beta1, beta2)
        self.stride, self.val_fraction, self.compile = stride, val_fraction, compile
        self._compiled: tuple[nn.Module, Any] | None = None
        self.ctx: Any = None  # the run context, set by the product (training.recipe.context.RunContext)
        text, self.vocab, self.corpus_sha256 = read_corpus()
        self._stoi = {ch: i for i, ch in enumerate(self.vocab)}
        tokens = self.encode(text)
        n_train = int(len(tokens) * (1 - val_fraction))
        self._train, self._val = tokens[:n_train], tokens[n_train:]
        # Streaming mode: token shards (nanoGPT's train.bin, or many .bin/.npy shards) in a folder or bucket, read by
        # training.data.ShardedDataset: samples are non-overlapping blocks of the packed stream.
        self.data_url, self.val_url, self.data_options = data_url, val_url, dict(data_options or {})
        secret = credential_keys(self.data_options)
        if secret:  # recipe_args are recorded with every checkpoint
            raise ValueError(
                f"data_options: {secret[0]!r} looks like a credential; recipe_args are stored with the run, so give "
                f"credentials through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)"
            )
        if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 2):
            raise ValueError(f"vocab_size={vocab_size!r}: use a whole number >= 2 (the token shards' vocabulary)")
        if vocab_size is not None and data_url is None:
            raise ValueError("vocab_size: only with data_url (the shipped corpus has its own vocabulary)")
        self.vocab_size = vocab_size or len(self.vocab)
        self._shards: Any = None
        if data_url is not None and val_url is None:  # streaming without a validation folder: nothing to evaluate
            self.evaluate = None  # type: ignore[method-assign,assignment]

    def state_dict(self) -> dict[str, str]:
        """Checkpointed with the run: which corpus (and so which vocabulary) the weights were trained on."""
        if self.data_url is not None:
            shards: Any = self.train_dataset()
            return {"shards_sha256": hashlib.sha256(shards.index.to_json()).hexdigest()}
        return {"corpus_sha256": self.corpus_sha256, "vocab": self.vocab}

    def load_state_dict(self, state: dict[str, str]) -> None:
        """A resume on another corpus would train on other data, or map characters to the wrong embeddings,
        without an error (recipe_args are the same): refuse it. ConfigError: the product does not retry it."""
        if self.data_url is not None:
            if state.get("shards_sha256") != self.state_dict()["shards_sha256"]:
                raise ConfigError(
                    f"recipes.gpt: this run's checkpoints were trained on other token shards than {self.data_url} "
                    f"holds now (their index differs); restore the shards or start a new run_name"
                )
            return
        if state.get("corpus_sha256") != self.corpus_sha256:
            raise ConfigError(
                f"recipes.gpt: this run's checkpoints were trained on a corpus with sha256 "
                f"{state.get('corpus_sha256')}, but {CORPUS} has sha256 {self.corpus_sha256}; restore that file or "
                f"start a new run_name"
            )

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._stoi[ch] for ch in text], dtype=torch.int64)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocab[int(i)] for i in tokens)

    def train_dataset(self) -> Dataset:
        if self.data_url is not None:
            if self._shards is None:
                self._shards = self._stream(self.data_url)
            return self._shards
        return Blocks(self._train, self.block_size, self.stride)

    def _stream(self, url: str) -> Any:
        from training.data import ShardedDataset

        return ShardedDataset(  # no data_options: the worker's TRAIN_DATA_STORAGE_OPTIONS, if any
            url,
            "tokens",
            block_size=self.block_size,
            storage_options=self.data_options or None,
            vocab_size=self.vocab_size,
        )

    def eval_dataset(self) -> Dataset:
        """The validation split in non-overlapping blocks: every character is scored once per evaluation."""
        if self.data_url is not None:
            if self.val_url is None:
                raise ConfigError("recipes.gpt: evaluating streamed token shards needs recipe_args val_url")
            return self._stream(self.val_url)
        return Blocks(self._val, self.block_size, self.block_size)

    def build_model(self) -> nn.Module:
        return CharGPT(
            self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd, self.dropout, self.bias
        )

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW, two groups: decay on weights of >= 2 dimensions (matmuls, embeddings), none on the rest."""
        params = [p for p in model.parameters() if p.requires_grad]  # a tied weight is listed once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        device = getattr(getattr(self, "ctx", None), "device", None)
        fused = device is not None and device.type == "cuda"  # nanoGPT uses the fused kernel where there is one
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, fused=fused or None)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Warm-up then cosine to ``min_lr`` at the run's last optimizer step (``ctx.total_steps - 1``), unless
        ``lr_decay_steps`` says otherwise. A plain function, not an object: LambdaLR checkpoints an object's
        attributes and would restore the old step count after a batch-size change."""
        if not self.decay_lr:
            return None
        decay_steps = self.lr_decay_steps if self.lr_decay_steps is not None else self.ctx.total_steps - 1
        assert self.ctx is not None, "load_recipe sets ctx before build_scheduler"
        lr_at = warmup_cosine(self.lr, self.min_lr, self.warmup_steps, decay_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_at(it) / self.lr)

    def maybe_compiled(self, model: nn.Module) -> nn.Module:
        """``model``, or with ``compile=True`` its ``torch.compile`` (nanoGPT's ``compile``), made on first use.
        Not in build_model: a compiled module's state_dict prefixes every key with ``_orig_mod.``, and checkpoints
        and exports should hold the model's own keys."""
        if not self.compile:
            return model
        if self._compiled is None or self._compiled[0] is not model:
            self._compiled = (model, torch.compile(model))
        compiled: Any = self._compiled[1]  # torch.compile's wrapper: called like the module
        return compiled

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        logits = self.maybe_compiled(model)(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def evaluate(self, model: nn.Module, batch) -> dict[str, float]:
        """Per-batch means, averaged over samples by the product: loss and bits per character (both linear in
        the loss). Perplexity is exp(eval_loss): a mean of per-batch perplexities would be another number."""
        loss = float(self.loss(model, batch))
        return {"loss": loss, "bits_per_char": loss / math.log(2)}

    @torch.no_grad()
    def generate(
        self,
        model: nn.Module,
        prompt: str,
        num_chars: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> str:
        """Samples ``num_chars`` characters after ``prompt`` (nanoGPT's ``sample.py``), for people, not training."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        idx = self.encode(prompt or "\n").unsqueeze(0).to(device)
        for _ in range(num_chars):
            logits = model(idx[:, -self.block_size :])[:, -1, :] / temperature
            probs = F.softmax(logits.float(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        model.train(was_training)
        return self.decode(idx[0, -num_chars:])
