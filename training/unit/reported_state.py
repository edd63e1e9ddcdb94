"""What ``ctx.report`` accepts: a state that ``torch.load(weights_only=True)`` loads back, and numeric metrics.

A checkpoint must never need code to load (a shared bucket could otherwise run code on every reader), so a
state holding a lambda, a lock or an object of the user's own class is refused when it is reported, naming
where it sits (``state['sampler']['fn']``), rather than written and refused by every later load. Known-safe
parts (tensors, numbers, strings, lists/tuples/dicts) are walked, which is cheap; anything else is saved and
loaded back on its own, so that the answer is exactly the one ``weights_only`` loading will give.
"""

from __future__ import annotations

import inspect
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from checkpointing.serialization import safe_load, serialize
from training.exceptions import ReportError

_PLAIN = (bool, int, float, str, bytes, type(None))
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_loadable(state: Any, name: str = "state") -> None:
    """ReportError unless ``torch.load(weights_only=True)`` can load ``state`` back: tensors and plain containers.
    Known-safe parts are walked (cheap); anything else is saved and loaded back on its own, and named if refused."""
    if not isinstance(state, Mapping):
        raise ReportError(
            f"ctx.report({name}=...): give a dict (e.g. {{'model': model.state_dict()}}), not {_kind(state)}"
        )
    unknown: list[tuple[str, Any]] = []
    _walk(state, name, unknown, set())
    for path, obj in unknown:
        problem = _round_trip_problem(obj)
        if problem:
            raise ReportError(
                f"ctx.report: {path} is {_kind(obj)}, which torch.load(weights_only=True) refuses to load ({problem}); "
                f"a checkpoint holds tensors, numbers, strings and lists/tuples/dicts of them only (so that loading "
                f"it can never run code): save its state_dict() or plain values instead"
            )


def _walk(obj: Any, path: str, unknown: list[tuple[str, Any]], seen: set[int]) -> None:
    kind = type(obj)
    if kind in _PLAIN or kind in _TENSORS:
        return
    if kind in (dict, OrderedDict, list, tuple):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if type(key) not in _PLAIN:
                unknown.append((f"{path} key {key!r}", key))
            _walk(value, f"{path}[{key!r}]", unknown, seen)
        return
    unknown.append((path, obj))


def _round_trip_problem(obj: Any) -> str:
    try:
        safe_load(serialize({"x": obj})["x"], "state")
    except (pickle.PicklingError, AttributeError, TypeError) as exc:  # cannot even be saved (a lambda, a lock)
        return f"it cannot be saved: {type(exc).__name__}: {exc}"
    except Exception as exc:  # torch's message is a page long: keep the line that names the type
        found = re.search(r"WeightsUnpickler error: (.*?)(?:\. |$)", str(exc.__cause__ or exc), flags=re.MULTILINE)
        return found.group(1) if found else "not among the types it loads"
    return ""


def _kind(obj: Any) -> str:
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return "a lambda" if obj.__name__ == "<lambda>" else f"the function {obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Names to floats (ints, floats, one-element tensors, NumPy scalars): they go into the manifest as JSON."""
    if not isinstance(metrics, Mapping):
        raise ReportError(
            f"ctx.report(metrics=...): give a dict of numbers, e.g. {{'loss': 0.41}}, not {_kind(metrics)}"
        )
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or isinstance(value, (str, bytes)):
            raise ReportError(f"ctx.report(metrics=...): {name!r}: {value!r}: use str names and numbers")
        try:
            values[name] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ReportError(f"ctx.report(metrics=...): {name!r}: {value!r} is not a number ({exc})") from exc
    return values
