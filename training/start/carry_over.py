"""What a checkpoint carries into a run, and the rule for what it does not: the state must fit the recipe's objects
whole, and a NEW run keeps its own hyper-parameters.

A run that resumes its own checkpoint takes everything back: the checkpoint's state is the run's state. A new run
started from a full checkpoint (``load_path`` naming one of our checkpoint or run folders, or a Composer, Lightning
or MindSpore file, with ``load_weights_only=false``) is another matter: its config was written for it, so

- the optimizer's *state* (moments, step counts) is carried, and so are the progress counters;
- its *hyper-parameters* (every param group's lr, weight decay, momentum, betas, ...) are the ones the recipe builds
  for this run, and the LR schedule is the recipe's, continued at the carried step; one line says which values
  differ from the checkpoint's (without the rule, the checkpoint's learning rate silently won over the new one).

Whatever is loaded must fit first: a model, an optimizer state or a progress that does not is one ``ConfigError``
naming the first keys that differ, never torch's message alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpointing.peers.weights import match, mismatch_text, tied_keys
from training.config import ConfigError
from training.position.progress import Progress
from training.start.optimizer_state import check_entries, check_groups, check_structure

logger = logging.getLogger(__name__)

# Param-group keys that are not hyper-parameters of an optimizer kind: present in several (lr, weight_decay), added
# by a scheduler (initial_lr) or by newer torch versions (the flags). Two states whose groups differ in the other keys
# (momentum vs betas) are of different optimizers.
_SHARED = {"params", "param_names", "lr", "initial_lr", "weight_decay", "maximize", "foreach", "capturable",
           "differentiable", "fused", "decoupled_weight_decay"}  # fmt: skip
_FLAGS = {"params", "param_names", "lr", "initial_lr", "foreach", "capturable", "differentiable", "fused"}


def check_model_fits(model: torch.nn.Module, state_dict: Mapping[str, Any], what: str, fix: str) -> None:
    """A full checkpoint's weights must fit the model key for key and shape for shape (tied keys count once); else
    one ConfigError naming ``what``, the first keys that differ, and ``fix``. Works on a model on the meta device."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    _, report = match(shapes, state_dict, aliases=tied_keys(model))
    if not report.ok:
        raise ConfigError(
            f"{what} does not fit the model this configuration builds: {mismatch_text(report, ways_out=False)}; {fix}"
        )


def load_model_state(model: torch.nn.Module, state_dict: Mapping[str, Any], what: str, fix: str) -> None:
    """Loads a full checkpoint's weights once ``check_model_fits`` passed."""
    check_model_fits(model, state_dict, what, fix)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:  # what match does not see (a wrapper prefix on some keys only, say)
        raise ConfigError(f"{what} does not fit the model: {str(exc).splitlines()[0]}; {fix}") from exc


def check_optimizer_fits(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: list[str], what: str, fix: str
) -> None:
    """The optimizer ``state`` (parameters by index, in ``optimizer``'s order; ``names`` their model keys) fits
    ``optimizer``: the same groups and sizes, the same kind of optimizer, each entry what the optimizer keeps for its
    parameter (training/start/optimizer_state.py)."""
    check_structure(state, what, fix)
    groups, saved = optimizer.param_groups, list(state.get("param_groups") or [])
    mine = type(optimizer).__name__
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in groups]:
        raise ConfigError(
            f"{what}: its optimizer state has parameter groups of {[len(g['params']) for g in saved]} parameters, the "
            f"recipe's {mine} {[len(g['params']) for g in groups]}; {fix}"
        )
    theirs_keys = {k for g in saved for k in g} - _SHARED
    mine_keys = {k for g in groups for k in g} - _SHARED
    if theirs_keys != mine_keys:
        raise ConfigError(
            f"{what}: its optimizer state is another optimizer's (its groups have {sorted(theirs_keys - mine_keys)}, "
            f"the recipe's {mine} has {sorted(mine_keys - theirs_keys)}); {fix}"
        )
    check_groups(optimizer, state, what, fix)
    check_entries(optimizer, state, names, what, fix)


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model key of each of the optimizer's parameters, in the optimizer's order (what its state is indexed by)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [names.get(id(p), f"<parameter {i} (not the model's)>") for i, p in enumerate(params)]


@dataclass
class ThisRun:
    """The hyper-parameters the recipe built for this run, taken before a checkpoint is loaded over them."""

    groups: list[dict[str, Any]]  # each param group but its parameters
    base_lrs: list[float] | None  # the LR scheduler's, which its schedule multiplies

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, scheduler: Any) -> ThisRun:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        base_lrs = getattr(scheduler, "base_lrs", None)
        return cls(groups, list(base_lrs) if base_lrs is not None else None)

    def restore(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> list[str]:
        """Puts this run's hyper-parameters back over the loaded ones (the optimizer's state stays); returns
        ``'<name> <checkpoint's> -> <this run's>'`` for each value that differed."""
        changes: list[str] = []
        for i, (group, mine) in enumerate(zip(optimizer.param_groups, self.groups, strict=True)):
            changes += _changes(group, mine, f"group {i} " if len(self.groups) > 1 else "")
            params = group["params"]
            group.clear()
            group.update({**mine, "params": params})
        if self.base_lrs is not None:
            scheduler.base_lrs = list(self.base_lrs)
        return changes


def log_hyperparameters(changes: list[str]) -> None:
    """The one line that says whose hyper-parameters a new run trains with."""
    if changes:
        logger.info(
            "load_path: this run's optimizer hyper-parameters apply, not the checkpoint's: %s (checkpoint's "
            "-> this run's); the optimizer's state (moments, step counts) is the checkpoint's",
            ", ".join(changes),
        )
    else:
        logger.info(
            "load_path: the optimizer's hyper-parameters are this run's and equal the checkpoint's; its state "
            "(moments, step counts) is the checkpoint's"
        )


def continue_schedule(scheduler: Any, step: int) -> bool:
    """Moves a step-based LR schedule to ``step`` (after a batch-size change renumbered steps, or a new run took a
    checkpoint's progress). False when only the counter could be moved (a chainable scheduler without a closed
    form)."""
    if scheduler is None:
        return True
    scheduler.last_epoch = step
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)
    if closed_form is None and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):

        def closed_form() -> list[Any]:
            return [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]

    if closed_form is not None:
        lrs = closed_form()
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = list(lrs)
    return closed_form is not None


def peer_progress(counts: Mapping[str, int], epoch_size: int) -> tuple[Progress, str]:
    """A peer's counters (Progress's names) as a Progress, at the peer's global batch size where it recorded one
    (``reposition`` then rescales the step to this run's); and a note on what had to be assumed."""
    epoch, step = counts.get("epoch", 0), counts.get("step", 0)
    if "samples_seen" in counts:
        sample_in_epoch = counts.get("sample_in_epoch", 0)
        return Progress(epoch, step, counts["samples_seen"], sample_in_epoch, counts.get("global_batch_size", 0)), ""
    note = f"samples_seen = {epoch} epochs x {epoch_size} samples (the file records no sample count)"
    batch = _peer_batch(epoch, step - counts.get("batch_in_epoch", 0), epoch_size)
    if batch:
        note += (
            f"; its {step - counts.get('batch_in_epoch', 0)} steps in {epoch} epochs make a global batch of {batch} "
            f"samples, so the step is counted again in this run's batches"
        )
    if counts.get("batch_in_epoch"):
        note += (
            f"; epoch {epoch} restarts at its first sample (the file says {counts['batch_in_epoch']} of its batches "
            f"were trained but records no batch size; data_skip_steps=<n> skips n batches)"
        )
    return Progress(epoch, step, epoch * epoch_size, 0, batch), note


def _peer_batch(epochs: int, steps: int, epoch_size: int) -> int:
    """The peer's global batch size where its counters tell it: ``steps`` optimizer steps over ``epochs`` whole epochs
    of ``epoch_size`` samples (the last batch of an epoch may be short); 0 when they do not. With it, ``reposition``
    counts the step in this run's batches (``samples_seen // global_batch_size``), as for a peer that records it."""
    if epochs <= 0 or steps <= 0 or epoch_size <= 0 or steps % epochs:
        return 0
    per_epoch = steps // epochs
    return -(-epoch_size // per_epoch) if per_epoch <= epoch_size else 0


def _changes(theirs: Mapping[str, Any], mine: Mapping[str, Any], prefix: str) -> list[str]:
    """The hyper-parameters that differ; lr is the schedule's base (``initial_lr``) where a scheduler set one."""
    found = []
    their_lr, my_lr = theirs.get("initial_lr", theirs.get("lr")), mine.get("initial_lr", mine.get("lr"))
    if their_lr is not None and not _same(their_lr, my_lr):
        found.append(f"{prefix}lr {_text(their_lr)} -> {_text(my_lr)}")
    for key in mine:
        if key not in _FLAGS and key in theirs and not _same(theirs[key], mine[key]):
            found.append(f"{prefix}{key} {_text(theirs[key])} -> {_text(mine[key])}")
    return found


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to float32's precision: MindSpore keeps its learning rate as a float32 tensor."""
    a, b = _plain(a), _plain(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return bool(a == b)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # a tensor lr (capturable optimizers)
        return value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else value


def _text(value: Any) -> str:
    value = _plain(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return str(value)
