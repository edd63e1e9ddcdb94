"""Token shards for the streaming-data tests: every token of sample ``g`` (its block and the token after it) is
``g``, so a test reads back which sample training was fed from the batch itself."""

from __future__ import annotations

from typing import Any

import fsspec
import numpy as np

BLOCK = 8
# Shards of uneven sizes (samples), so that batches and windows straddle shard boundaries.
SAMPLES = (37, 50, 41, 64, 29, 55)


def write_token_shards(url: str, storage_options: dict[str, Any] | None = None, samples=SAMPLES) -> int:
    """Writes ``shard-<j>.bin`` (uint16) under ``url``; returns the total number of samples."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    first = 0
    for j, n in enumerate(samples):
        ids = np.arange(first, first + n, dtype=np.uint16)
        tokens = np.concatenate([np.repeat(ids, BLOCK), [first + n - 1]]).astype(np.uint16)
        fs.pipe_file(f"{root}/shard-{j:03d}.bin", tokens.tobytes())
        first += n
    return first
