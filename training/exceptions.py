"""Every error of a run above the checkpoint layer, in one leaf module (checkpointing/errors.py holds the layer's own).

An error that no retry can cure carries the ``Permanent`` marker, directly or through ``UsageError``: the unit's
retry policy (tasks/train_unit.py) reads the marker, and a rank's error crosses the torchrun boundary as the same type
(training/distributed/errors.py) because its class is in one of the two modules. A new error class goes here (or
there), so both see it without a list to update.

The classes are still importable from the modules that raise them (``training.config.ConfigError``,
``training.unit.own_loop.LoopEndedEarlyError``, ...). ``Preempted`` is not here: it is a stop, not an error (a
BaseException carrying the ``Stop`` it answers), and lives with the stop machinery in training/preemption.py.
"""

from __future__ import annotations

from checkpointing.errors import Permanent

__all__ = [
    "ConfigError",
    "DataError",
    "DistributedUnitError",
    "InjectedFault",
    "LoopEndedEarlyError",
    "NodeFailed",
    "OfferRefused",
    "Permanent",
    "RemoteError",
    "ReportError",
    "RestartLimitError",
    "UsageError",
]


# -- mistakes: the same inputs fail the same way -------------------------------------------------------------------
class UsageError(ValueError, Permanent):
    """What the run was given cannot work: its configuration, or the recipe's own code. Never retried (it would fail
    the same way); the command line says it in one line and exits 2 (flows/cli.py)."""


class ConfigError(UsageError):
    """A configuration value the run cannot use."""


class ReportError(UsageError):
    """``ctx.report`` was given something it cannot commit safely."""


class LoopEndedEarlyError(UsageError):
    """``train_loop`` returned before any report reached ``max_duration``."""


class DataError(ValueError, Permanent):
    """Streaming data that does not match its shard index, or that cannot be read as its format (training/data/): the
    message names the shard and the fix. Never retried: the same data fails the same way."""


class OfferRefused(ValueError, Permanent):
    """A node offer that this worker will not act on (unsigned, forged, expired or malformed): nothing is started.
    Not a mistake of the run's: whoever made the offer is not trusted, and the node says so (flows/node.py)."""


# -- failures a retry may cure -------------------------------------------------------------------------------------
class InjectedFault(RuntimeError):
    """Raised by ``inject_fault_at_step``: a deliberate, retryable failure for demos and tests."""


class DistributedUnitError(RuntimeError):
    """The ranks ended without a result (a rank failed or was killed). Retried by Prefect: the retry starts a
    fresh gang that resumes from the last checkpoint."""


class RankDied(DistributedUnitError):
    """A rank of the gang died (killed by a signal, or gone without a word): a crash of that rank, retried like any
    crash; the other ranks' stop was torchrun's cleanup (training/distributed/deaths.py). ``signature``: (rank, exit
    code, step), what identifies it when it repeats."""

    def __init__(self, message: str, signature: tuple[int, int | None, int | None] | None = None):
        super().__init__(message)
        self.signature = signature


class NodeFailed(RuntimeError):
    """This node's torchrun ended with an error (a rank failed, or node 0 went away)."""


class RemoteError(RuntimeError):
    """An error of another process that is none of the product's own types (retried like any failure)."""


# -- a sweep's trials (tasks/trial.py) ------------------------------------------------------------------------------
class TrialStopped(RuntimeError, Permanent):
    """A trial's process stopped on request (the sweep is being preempted): the sweep's relaunch resumes it."""


class TrialFailed(RuntimeError, Permanent):
    """A trial's run failed (its own unit retries spent) or its configuration was refused: the sweep records it."""


class TrialDied(RuntimeError):
    """A trial's process died without saying why (a signal, the OOM killer): retried, and the retry resumes."""


# -- the flow's own end --------------------------------------------------------------------------------------------
class RestartLimitError(RuntimeError):
    """The flow run was restarted more often than ``max_restarts``: it ends Failed, which no automation restarts."""
