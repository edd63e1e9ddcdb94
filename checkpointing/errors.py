"""Every error of the checkpoint layer, in one leaf module that imports nothing of the product.

``Permanent`` marks an error that no retry can cure (an unsafe checkpoint, a fenced writer, denied credentials, a
location that became a link): the unit's retry policy (tasks/train_unit.py) does not retry it, and a rank's error
crosses the torchrun boundary as its own type (training/distributed/errors.py), marker included. Both read the marker
and this module, never a list of classes. ``training.exceptions`` adds training's errors on top of these.

The classes are still importable from the modules that raise them (``checkpointing.store.NotACheckpointError``, ...)
and the package's face (``from checkpointing import FencedError``).
"""

from __future__ import annotations


class Permanent:
    """Marks an error that retrying cannot help: the same inputs fail the same way. No behaviour of its own."""


# -- checkpoints ---------------------------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """Base class for checkpoint problems."""


class UnsafeCheckpointError(CheckpointError, Permanent):
    """A checkpoint file holds something that only an unsafe (code-running) unpickler could load, or more
    than its size can hold."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match what its manifest vouches for, or do not load."""


class NotACheckpointError(CheckpointError, ValueError, Permanent):
    """A URI given as a checkpoint names no checkpoint or run."""


class FencedError(CheckpointError, Permanent):
    """A newer writer generation owns this run; this writer must stop."""


class ReleaseError(CheckpointError):
    """``release.json`` is there but is not a release this code can trust; the message names the problem."""


class LedgerError(CheckpointError, Permanent):
    """A sweep's event ledger holds an event this code cannot trust; the message names the file and the fix."""


class LedgerFencedError(LedgerError):
    """Another sweep process appended to the same ledger: this one must stop."""


class ManifestError(ValueError):
    """A manifest is missing, torn, altered or of a format this code cannot read."""


# -- other trainers' files -----------------------------------------------------------------------------------------
class WeightsError(CheckpointError, ValueError):
    """A weights file that cannot be used as given: missing, not a regular file, unknown layout, mismatch."""


class MindSporeFormatError(CheckpointError, ValueError):
    """Not a MindSpore checkpoint this reader can decode (message names the problem, never the bytes)."""


# -- storage -------------------------------------------------------------------------------------------------------
class StorageError(RuntimeError):
    """An object-store operation failed for good: retries exhausted (this base class) or a permanent error."""


class PermanentStorageError(StorageError, Permanent):
    """No retry can cure it (no such bucket, access denied, invalid request): never retried as a unit."""


class AccessDeniedError(PermanentStorageError):
    """The store refused the credentials (403): the message says to check them."""


class DamagedFileError(ValueError):
    """A small file of a store is too big, nested too deep, not JSON, or not of the expected shape."""


class UnsafePathError(FileNotFoundError):
    """A path inside the run folder is a symbolic link or not a regular file: damage, never followed.
    A FileNotFoundError, so that readers treat it as missing and fall back."""


class LinkedLocationError(RuntimeError, Permanent):
    """A location a run's parameters chose became (or holds) a symbolic link below the worker's allowed root: never
    followed, and permanent (no retry makes it a real folder again)."""


class TierUnavailable(Exception):
    """The host-memory tier cannot be used here (the message says why); training goes on without it."""
