"""Streaming data from a folder of shards: ``from training.data import ShardedDataset``. The dataset (dataset.py), the
shard index (index.py), the formats (formats/), the local cache (cache.py) and the epoch's order (order.py)."""

from __future__ import annotations

from training.data.dataset import FORMATS, ShardedDataset
from training.data.index import INDEX_FILE, ShardIndex
from training.data.order import WindowedOrder

__all__ = ["FORMATS", "INDEX_FILE", "ShardIndex", "ShardedDataset", "WindowedOrder"]
