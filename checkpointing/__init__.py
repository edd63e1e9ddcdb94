"""Checkpoints in an object store: checksummed, committed manifest-last, loaded without running code.

No Prefect import here: this layer is plain fsspec + tenacity + torch, and torch is imported only where a
checkpoint is serialized or loaded, so `python -m checkpointing ls|verify` start without it (~1.4 s less).
"""

from checkpointing.manifest import Manifest, Writer
from checkpointing.storage import AccessDeniedError, PermanentStorageError, RetrySettings, StorageError
from checkpointing.store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    CorruptCheckpointError,
    FencedError,
    LoadedCheckpoint,
    NotACheckpointError,
    UnsafeCheckpointError,
    open_checkpoint_uri,
    validate_name,
)

__all__ = [
    "AccessDeniedError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CorruptCheckpointError",
    "FencedError",
    "LoadedCheckpoint",
    "Manifest",
    "NotACheckpointError",
    "PermanentStorageError",
    "RetrySettings",
    "StorageError",
    "UnsafeCheckpointError",
    "Writer",
    "open_checkpoint_uri",
    "validate_name",
]
