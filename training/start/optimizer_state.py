"""What an optimizer state may hold before it is loaded: every entry typed and sized against the recipe's optimizer.

``Optimizer.load_state_dict`` takes whatever a checkpoint holds: a 0-dim, string or list ``momentum_buffer``, or an
``exp_avg`` missing beside its ``step``, loads without a word and fails at the first step with torch's RuntimeError,
AttributeError or KeyError, after the run was claimed, and again on every retry. Checked here instead, it is one
ConfigError naming the parameter and the entry, at start-up, never retried.

torch says what it keeps: the recipe's optimizer class, with each group's hyper-parameters, takes one step on a small
probe parameter of the same number of dimensions, and its state is the template (``exp_avg``: the parameter's shape;
Adam's ``step``: a scalar; Adafactor's ``row_var``: a smaller tensor). An optimizer that cannot take such a step
(LBFGS wants a closure, SparseAdam sparse gradients, a recipe's own that wants more arguments) falls back to the shape
rule alone: tensors of the parameter's shape, scalars, or None. Key names are quoted only when torch's optimizers use
them: the file's own strings are never repeated.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch

from training.config import ConfigError

PARAM, SCALAR, SMALLER = "param", "scalar", "smaller"
_PROBE = (2, 3, 5, 7, 11, 13, 17, 19)  # distinct sizes: a template tensor's shape tells which dims it keeps
# The entries torch's own optimizers keep: these names may appear in a message (any other is the file's text).
_TORCH_KEYS = {
    "step",
    "momentum_buffer",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "sum",
    "square_avg",
    "grad_avg",
    "acc_delta",
    "mu_product",
    "eta",
    "mu",
    "ax",
    "prev",
    "step_size",
    "exp_inf",
    "row_var",
    "col_var",
}
Template = dict[str, str]  # entry name -> PARAM | SCALAR | SMALLER


def check_structure(state: Any, what: str, fix: str) -> None:
    """A torch optimizer state_dict: ``{"state": {index: {name: value}}, "param_groups": [{"params": [index]}]}``."""
    if not _is_state_dict(state):
        raise ConfigError(
            f"{what}: its optimizer state is not a torch optimizer state_dict ({{'state': {{index: {{name: tensor}}}}, "
            f"'param_groups': [{{'params': [index, ...], ...}}]}}); {fix}"
        )


def _is_state_dict(state: Any) -> bool:
    if not isinstance(state, Mapping):
        return False
    groups, entries = state.get("param_groups"), state.get("state")
    if not isinstance(groups, list) or not isinstance(entries, Mapping):
        return False
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        return False
    indexes = all(_is_index(i) for g in groups for i in g["params"])
    return indexes and all(_is_index(k) and (v is None or isinstance(v, Mapping)) for k, v in entries.items())


def check_entries(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: list[str], what: str, fix: str
) -> None:
    """Each saved entry of each parameter is what the recipe's optimizer keeps for it (``names``: the parameters'
    model keys, in the optimizer's order); ``state`` passed ``check_structure`` and has the recipe's group sizes."""
    mine = type(optimizer).__name__
    templates: dict[tuple[int, int], Template | None] = {}
    saved_ids = [i for g in state["param_groups"] for i in g["params"]]
    positions = [(gi, p) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]
    for position, (index, (group, param)) in enumerate(zip(saved_ids, positions, strict=True)):
        entry = state["state"].get(index)
        if not entry:
            continue  # no state yet: torch starts it at the first step
        key = (group, param.dim())
        if key not in templates:
            templates[key] = template(optimizer, group, param.dim())
        problem = _entry_problem(entry, tuple(param.shape), templates[key])
        if problem:
            raise ConfigError(
                f"{what}: its optimizer state does not fit the recipe's {mine}: for parameter "
                f"{names[position]!r}, {problem}; {fix}"
            )


def check_groups(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], what: str, fix: str) -> None:
    """Each hyper-parameter a saved param group shares with the recipe's is of the same kind (a number, a flag, a
    pair of numbers): a resumed run trains with the saved ones, and a string learning rate fails at the first step."""
    for i, (saved, mine) in enumerate(zip(state["param_groups"], optimizer.param_groups, strict=True)):
        for key in sorted(k for k in mine.keys() & saved.keys() if k not in ("params", "param_names")):
            if not _same_kind(saved[key], mine[key]):
                raise ConfigError(
                    f"{what}: its optimizer state's param group {i} has {_what(saved[key])} for {key}, "
                    f"the recipe's {type(optimizer).__name__} {_what(mine[key])}; {fix}"
                )


def _same_kind(saved: Any, mine: Any) -> bool:
    if isinstance(mine, (list, tuple)):
        return (
            isinstance(saved, (list, tuple))
            and len(saved) == len(mine)
            and all(_same_kind(a, b) for a, b in zip(saved, mine, strict=True))
        )
    if mine is None:  # "torch decides" (foreach, fused) or an option the recipe left unset
        return saved is None or type(saved) is bool or _is_scalar(saved)
    if type(mine) is bool:
        return saved is None or type(saved) is bool
    if _is_scalar(mine):
        return _is_scalar(saved)
    return type(saved) is type(mine)


def template(optimizer: torch.optim.Optimizer, group: int, dims: int) -> Template | None:
    """What ``type(optimizer)`` keeps for a parameter of ``dims`` dimensions in param group ``group`` after a step;
    None when it cannot take one on a probe."""
    if dims > len(_PROBE):
        return None
    options = {k: v for k, v in optimizer.param_groups[group].items() if k not in ("params", "param_names")}
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            options = {k: v for k, v in options.items() if k in accepted}
        probe = torch.nn.Parameter(torch.zeros(_PROBE[:dims]))
        twin = type(optimizer)([probe], **options)
        probe.grad = torch.full_like(probe, 0.5)
        twin.step()
        kept = twin.state[probe]
    except Exception:  # anything: the probe only sharpens the check, the shape rule still applies
        return None
    return {str(k): _kind(v, probe.shape) for k, v in kept.items() if v is not None}


def _entry_problem(entry: Mapping[Any, Any], shape: tuple[int, ...], expected: Template | None) -> str:
    if expected is not None:
        missing = [k for k in expected if k not in entry]
        if missing:
            return f"{missing[0]} is missing (it keeps {', '.join(expected)})"
    for name, value in entry.items():
        kind = expected.get(name) if expected is not None and isinstance(name, str) else None
        problem = _value_problem(value, shape, kind)
        if problem:
            return f"{_name(name, expected)} is {problem}"
    return ""


def _value_problem(value: Any, shape: tuple[int, ...], kind: str | None) -> str:
    """Why ``value`` cannot be an entry of ``kind`` (None: any entry the shape rule allows) for a parameter of
    ``shape``; "" when it can."""
    want = list(shape)
    if kind in (None, SCALAR) and _is_scalar(value):
        return ""
    if kind is None and value is None:
        return ""
    if not isinstance(value, torch.Tensor):
        return f"{_what(value)}, not {'a scalar' if kind == SCALAR else f'a tensor of shape {want}'}"
    got = list(value.shape)
    if kind == SMALLER:
        if value.dim() <= max(len(shape), 1) and value.numel() <= max(math.prod(shape), 1):
            return ""
        return f"a tensor of shape {got}, larger than the parameter ({want})"
    if kind == SCALAR:
        return f"a tensor of shape {got}, not a scalar"
    if got != want:
        return f"a tensor of shape {got}, not {want} (the parameter's shape)"
    return ""  # any dtype: torch casts the state to the parameter's on load


def _kind(value: Any, probe: torch.Size) -> str:
    if isinstance(value, torch.Tensor) and value.shape == probe:
        return PARAM
    return SCALAR if _is_scalar(value) else SMALLER


def _is_scalar(value: Any) -> bool:
    """A 0-dim tensor or a plain number (torch turns an older file's number into a tensor on load)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex()
    return type(value) is int or (type(value) is float and math.isfinite(value))


def _is_index(value: Any) -> bool:
    return type(value) is int and value >= 0


def _what(value: Any) -> str:
    """The kind of a value, never the value (it may be the file's text)."""
    if value is None:
        return "None"
    if _is_scalar(value):
        return "a number"
    kinds = {str: "a string", list: "a list", tuple: "a tuple", dict: "a dict", bool: "a flag"}
    return kinds.get(type(value), "a tensor" if isinstance(value, torch.Tensor) else "a value of another kind")


def _name(name: Any, expected: Template | None) -> str:
    """The entry's name where torch's optimizers use it, never the file's own text."""
    if isinstance(name, str) and (name in _TORCH_KEYS or (expected is not None and name in expected)):
        return name
    return "an entry the recipe's optimizer does not keep"
