"""How much one run may start on this worker: processes per machine and machines, capped by the worker's environment.

TrainConfig bounds ``nproc_per_node`` at 1024 and ``nnodes`` at 100,000, which is sane for a person at a terminal on
their own machines. A deployment run's parameters are chosen by whoever may create runs, and the worker starts what
they ask: a thousand rank processes on one machine, or node runs for a hundred thousand machines of the pool. So, as
``TRAIN_ALLOWED_ROOTS`` says where a run may read and write (training/config/trust.py), the worker's operator says how much
one untrusted run may start:

    TRAIN_MAX_NPROC_PER_NODE=8    # default: the machine's GPUs, or its CPUs where it has none
    TRAIN_MAX_NNODES=4            # default: 8

Checked when a deployment run opens (``Run.open(untrusted=True)``) and by every node run for its own machine, before
anything is claimed or started; one ConfigError names the option, the value, the cap and the variable.
``python -m flows.train`` and ``train()`` from Python are the person's own choices and are not capped.
"""

from __future__ import annotations

import os

from training.config import ConfigError, TrainConfig

NPROC_ENV, NNODES_ENV = "TRAIN_MAX_NPROC_PER_NODE", "TRAIN_MAX_NNODES"
DEFAULT_MAX_NNODES = 8


def check_limits(config: TrainConfig) -> None:
    """ConfigError when ``config`` asks for more processes per machine or more machines than this worker allows."""
    for option, variable, cap in (
        ("nproc_per_node", NPROC_ENV, max_nproc_per_node()),
        ("nnodes", NNODES_ENV, max_nnodes()),
    ):
        value = getattr(config, option)
        if value > cap:
            raise ConfigError(
                f"{option}={value} is more than this worker allows for one run ({cap}, {variable} in the worker's "
                f"environment{'' if variable in os.environ else ', by default'}); ask for at most {cap}, or ask the "
                f"worker's operator to raise {variable}"
            )


def max_nproc_per_node() -> int:
    """The worker's cap on rank processes per machine: the variable, else one per GPU, else one per CPU."""
    return _cap(NPROC_ENV) or _gpus() or len(os.sched_getaffinity(0))


def max_nnodes() -> int:
    return _cap(NNODES_ENV) or DEFAULT_MAX_NNODES


def _cap(variable: str) -> int | None:
    text = os.environ.get(variable, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 1_000_000:
        raise ConfigError(
            f"{variable}={text[:40]!r} in the worker's environment is not a whole number from 1 to 1000000: set it "
            f"to the most one run may start, or unset it for the default"
        )
    return int(text)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
