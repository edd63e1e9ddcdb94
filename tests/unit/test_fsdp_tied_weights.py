"""FSDP2 of a model with tied weights (training/unit/fsdp.py): the GPT recipe's head shares the token embedding's
weight, and ``parallelism="fsdp"`` failed on every rank at the first unit with "Parameter 'head.weight' is shared with
a parameter already managed by another FSDP group". The modules that hold a tied weight are left to the root's group.
The real run: tests/integration/test_format_kill.py's FSDP scenario (the GPT recipe, killed three times)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from recipes.gpt import CharGPT
from tests.conftest import ROOT
from training.unit.fsdp import _own_units


def test_modules_holding_a_tied_weight_are_left_to_the_root():
    model = CharGPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)

    units = _own_units(model)

    assert model.tok_emb not in units and model.head not in units  # one weight: one FSDP group, the root's
    assert model.pos_emb in units and model.ln_f in units and model.blocks[0].ln_1 in units  # the rest: their own


def test_a_model_with_tied_weights_is_sharded_and_trains_a_step(tmp_path):
    """In a process of its own: a process group is process-wide."""
    script = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        from recipes.gpt import CharGPT
        from training.unit.fsdp import shard_model
        dist.init_process_group("gloo", init_method="file://{tmp_path / "rendezvous"}", rank=0, world_size=1)
        torch.manual_seed(0)
        model = CharGPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
        shard_model(model, torch.device("cpu"))
        assert model.head.weight is model.tok_emb.weight  # still one tied weight
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = model.tok_emb.weight.full_tensor().clone()
        x = torch.randint(0, 64, (4, 8))
        model(x).logsumexp(-1).mean().backward()
        optimizer.step()
        assert not torch.equal(before, model.tok_emb.weight.full_tensor())
        dist.destroy_process_group()
        print("trained")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "trained", proc.stderr[-3000:]
