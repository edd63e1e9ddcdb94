"""Checkpoints in an object store: checksummed, committed manifest-last, loaded without running code.

No Prefect import here: this layer is plain fsspec + tenacity + torch, and torch is imported only where a
checkpoint is serialized or loaded, so `python -m checkpointing ls|verify` start without it (~1.4 s less).
"""

from checkpointing.copies import copy_checkpoint
from checkpointing.errors import (
    AccessDeniedError,
    CheckpointError,
    CorruptCheckpointError,
    FencedError,
    LedgerError,
    LedgerFencedError,
    NotACheckpointError,
    PermanentStorageError,
    StorageError,
    UnsafeCheckpointError,
)
from checkpointing.io.storage import RetrySettings
from checkpointing.ledger import Event, Ledger
from checkpointing.manifest import Manifest, Writer
from checkpointing.store import CheckpointInfo, CheckpointStore, LoadedCheckpoint, validate_name
from checkpointing.uris import open_checkpoint_uri

__all__ = [
    "AccessDeniedError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CorruptCheckpointError",
    "Event",
    "FencedError",
    "Ledger",
    "LedgerError",
    "LedgerFencedError",
    "LoadedCheckpoint",
    "Manifest",
    "NotACheckpointError",
    "PermanentStorageError",
    "RetrySettings",
    "StorageError",
    "UnsafeCheckpointError",
    "Writer",
    "copy_checkpoint",
    "is_weights_file",
    "open_checkpoint_uri",
    "read_weights",
    "validate_name",
]

_LAZY = {"read_weights": "checkpointing.peers.formats", "is_weights_file": "checkpointing.peers.formats"}


def __getattr__(name: str) -> object:
    """``read_weights`` and ``is_weights_file`` (any weights file or peer checkpoint, read without running code),
    imported on first use: they need torch, which ``python -m checkpointing ls`` never loads."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'checkpointing' has no attribute {name!r}")
