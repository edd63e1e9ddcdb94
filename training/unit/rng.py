"""Every random number generator that decides the next step, captured, restored, and kept to training alone.

States are stored as tensors and plain lists so that they load with ``weights_only=True``.

Python's ``random`` module is one generator shared by the whole process, and training is not its only user:
Prefect's event client (through ``websockets``) draws a ping payload from it on a background thread, s3fs's
HTTP pool shuffles connections with it, and so on. Those draws land between a recipe's own draws, so two
identical runs of a recipe that uses ``random`` in its data path ended with different weights (seen:
max |Δ| 1.5e-4), and the other way round, training's seeding made every draw of those libraries (retry
jitter included) the same in every run. So once training owns the generator (``seed_all``/``restore``, which
run on the training thread), the module's functions route by thread: the training thread draws from the
generator it seeded and restores, every other thread from a generator of its own, seeded by the OS. NumPy's
and torch's global generators have no such background users; they are seeded and restored as they are.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import torch

np: Any
try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None

# The module-level functions of ``random`` that read or change its one generator.
_ROUTED = [
    "betavariate",
    "binomialvariate",
    "choice",
    "choices",
    "expovariate",
    "gammavariate",
    "gauss",
    "getrandbits",
    "getstate",
    "lognormvariate",
    "normalvariate",
    "paretovariate",
    "randbytes",
    "randint",
    "random",
    "randrange",
    "sample",
    "seed",
    "setstate",
    "shuffle",
    "triangular",
    "uniform",
    "vonmisesvariate",
    "weibullvariate",
]
_TRAINING: random.Random = random._inst  # the generator random.seed() seeds: training's
_OTHERS = random.Random()  # seeded from os.urandom: every other thread's draws
_owner: int | None = None
_lock = threading.Lock()


def _route(name: str) -> Any:
    training, others = getattr(_TRAINING, name, None), getattr(_OTHERS, name, None)
    if training is None or others is None:  # a function this Python does not have (e.g. binomialvariate < 3.12)
        return None

    def draw(*args: Any, **kwargs: Any) -> Any:
        return (training if threading.get_ident() == _owner else others)(*args, **kwargs)

    draw.__name__ = draw.__qualname__ = name
    draw.__doc__ = training.__doc__
    return draw


def own_python_random() -> None:
    """Makes the calling thread the one whose draws come from training's generator (idempotent)."""
    global _owner
    with _lock:
        if _owner is None:
            for name in _ROUTED:
                routed = _route(name)
                if routed is not None:
                    setattr(random, name, routed)
        _owner = threading.get_ident()


def disown_python_random() -> None:
    """Undoes ``own_python_random``: ``random``'s functions are its own generator's again, for every thread, as in
    a fresh process (tests start each from there: training/process_state.py)."""
    global _owner
    with _lock:
        if _owner is not None:
            for name in _ROUTED:
                if hasattr(_TRAINING, name):
                    setattr(random, name, getattr(_TRAINING, name))
        _owner = None


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _py_to_plain(_TRAINING.getstate()), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    own_python_random()
    _TRAINING.setstate(_plain_to_py(state["python"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    own_python_random()
    _TRAINING.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def _py_to_plain(s: tuple) -> list:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _plain_to_py(s: list) -> tuple:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
