"""FSDP2 for a unit: a recipe's model sharded with ``fully_shard``, saved and loaded as a sharded checkpoint.

With DDP every rank holds the whole model, its gradients and its optimizer state, and rank 0 writes one
``state.pt``: the model must fit (twice) in one process. FSDP2 keeps 1/world of each parameter and of its
optimizer state on each rank; ``get_state_dict`` gives those shards as DTensors, and
``checkpointing.commit.sharded`` writes each rank's shards in parallel under the manifest → ``latest`` protocol.
Loading reshards, so the world size may change between units.

Besides the shards, a checkpoint holds two kinds of small ``torch.save`` files: ``extra.pt`` (rank 0's
``extra``: progress, scheduler state, anything every rank shares) and ``extra-rank<r>.pt`` (each rank's
``rank_extra``: its RNG states). A rank that did not exist when the checkpoint was written gets
``rank=None`` and must seed a stream of its own.

The process group (gloo on CPU, nccl on CUDA) is set up by ``training.distributed.rank.main`` as for DDP.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from checkpointing import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    CorruptCheckpointError,
    ranks,
)
from checkpointing.commit import sharded
from checkpointing.commit.committer import CommitTerms, PendingCommit, commit_sharded

logger = logging.getLogger(__name__)

EXTRA_FILE = "extra.pt"
SHARDS_FILE = "shards"  # in a snapshot of one rank (host memory only): its shards, as ``local_shards`` gives them


def rank_extra_file(rank: int) -> str:
    return f"extra-rank{rank}.pt"


@dataclass
class LoadedExtra:
    """What ``load_sharded`` gives back besides the model and optimizer it loaded in place."""

    common: dict[str, Any]  # rank 0's ``extra`` at save time
    rank: dict[str, Any] | None  # this rank's ``rank_extra`` at save time; None if the world grew
    files_read: list[str] = field(default_factory=list)  # by this rank: what "reads only what it needs" means


def shard_model(model: nn.Module, device: torch.device, *, units: Iterable[nn.Module] | None = None) -> nn.Module:
    """Moves ``model`` to ``device`` and shards it in place with FSDP2: each of ``units`` (default: every
    submodule that owns parameters itself, none of them tied to another's) gets its own ``fully_shard``, then the
    root, which takes the rest. Returns ``model``.

    Tied parameters (a GPT's token embedding and its output head share one weight) must be in one FSDP group;
    ``fully_shard`` refuses the second module otherwise ("is shared with a parameter already managed by another
    FSDP group"), so the modules that hold them are left to the root. The mesh is built for ``device``'s type, not
    guessed: a CPU run on a machine with a GPU stays on gloo."""
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    chosen = list(units) if units is not None else _own_units(model)
    for module in chosen:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _own_units(root: nn.Module) -> list[nn.Module]:
    """The submodules that own parameters themselves, less those owning a parameter another submodule owns too."""
    modules = [m for m in root.modules() if m is not root]
    holders = Counter(id(p) for m in modules for p in m.parameters(recurse=False))
    return [
        m
        for m in modules
        if any(True for _ in m.parameters(recurse=False))
        and all(holders[id(p)] == 1 for p in m.parameters(recurse=False))
    ]


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``, sharded (DTensors), keyed by parameter names (not ids), as DCP
    saves them. ``get_state_dict`` first creates optimizer state that a fresh optimizer lacks."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded(
    terms: CommitTerms,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    rank_extra: dict[str, Any] | None = None,
) -> PendingCommit:
    """Every rank calls it: writes its shards and its ``rank_extra``; rank 0 also ``extra``, then commits
    (manifest, then ``latest``) under ``terms`` through the one commit path. Every rank returns the committed
    checkpoint or raises the same error."""
    rank = dist.get_rank()
    files = {rank_extra_file(rank): rank_extra or {}}
    if rank == 0:
        files[EXTRA_FILE] = extra
    terms = replace(terms, metadata={**terms.metadata, "parallelism": "fsdp"})
    return commit_sharded(terms, state_dicts(model, optimizer), files)


def local_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``state_dicts`` with each DTensor replaced by this rank's shard of it (a plain tensor over the same memory):
    what a snapshot of this rank copies into host memory."""
    return _map_dtensors(state_dicts(model, optimizer), lambda t: t.to_local())


def load_local_shards(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Loads what ``local_shards`` gave (a snapshot of this rank, at this world size) back into the sharded model
    and optimizer. CorruptCheckpointError, before anything is changed, when a shard does not fit its place."""
    state = state_dicts(model, optimizer)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    grafted = _graft(state, saved, pairs)
    with torch.no_grad():
        for local, shard in pairs:
            local.copy_(shard)
    set_state_dict(model, optimizer, model_state_dict=grafted["model"], optim_state_dict=grafted["optimizer"])


def _graft(live: Any, saved: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``saved``'s tree with each of ``live``'s DTensors kept where ``saved`` holds its shard (listed in ``pairs`` to
    be copied in); everything else (step counters, hyper-parameters) as saved."""
    from torch.distributed.tensor import DTensor

    if isinstance(live, DTensor):
        local = live.to_local()
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            raise CorruptCheckpointError("a snapshot's shard does not fit this rank's (another world size?)")
        pairs.append((local, saved))
        return live
    if isinstance(saved, dict) and isinstance(live, dict):
        if set(saved) != set(live):
            raise CorruptCheckpointError("a snapshot holds other state than this model and optimizer")
        return {k: _graft(live[k], v, pairs) for k, v in saved.items()}
    return saved


def _map_dtensors(node: Any, fn: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(node, DTensor):
        return fn(node)
    if isinstance(node, dict):
        return {k: _map_dtensors(v, fn) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(_map_dtensors(v, fn) for v in node)
    return node


def load_sharded(
    store: CheckpointStore, info: CheckpointInfo, model: nn.Module, optimizer: torch.optim.Optimizer
) -> LoadedExtra:
    """Every rank calls it: loads ``info`` into the sharded ``model`` and ``optimizer`` (resharding to this
    world size) and returns the small extras. CorruptCheckpointError on every rank if any rank's files fail
    their check; the model may then hold part of the checkpoint: load another one before training."""
    rank = dist.get_rank()
    files = sharded.load_files(store, info, [EXTRA_FILE, rank_extra_file(rank)])
    if EXTRA_FILE not in files:
        raise CorruptCheckpointError(f"{info.uri}: the manifest lists no {EXTRA_FILE}")
    state = state_dicts(model, optimizer)
    read = sharded.load_state(store, info, state)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return LoadedExtra(
        common=files[EXTRA_FILE], rank=files.get(rank_extra_file(rank)), files_read=[*sorted(files), *read]
    )


def restore_latest(
    store: CheckpointStore, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[CheckpointInfo, LoadedExtra] | None:
    """Loads the run's newest checkpoint that verifies, falling back past corrupt ones; None if there is
    none. Rank 0 picks each candidate, so every rank tries the same one."""
    candidates = store.candidates() if dist.get_rank() == 0 else iter(())
    while (info := ranks.on_rank0(lambda: next(candidates, None))) is not None:
        if not sharded.is_sharded(info):
            raise CheckpointError(
                f"{info.uri} is not sharded (written with parallelism="
                f"{info.manifest.metadata.get('parallelism', 'ddp')!r}); FSDP resumes only from sharded checkpoints"
            )
        try:
            return info, load_sharded(store, info, model, optimizer)
        except CorruptCheckpointError as exc:
            logger.warning("skipping checkpoint %s: %s", info.name, exc)
    return None


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The whole model's state_dict on rank 0's CPU (other ranks get {}); every rank calls it. For
    evaluation, export and tests: it holds the full model in one process."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state, whole, on rank 0's CPU (others get {}); every rank calls it."""
    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": model_state, "optimizer": optimizer_state}
