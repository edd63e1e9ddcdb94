"""Streaming data from a folder of shards (training/data/shards.py): ``from training.data import ShardedDataset``."""

from __future__ import annotations

from training.data.index import INDEX_FILE, ShardIndex
from training.data.shards import FORMATS, ShardedDataset, WindowedOrder

__all__ = ["FORMATS", "INDEX_FILE", "ShardIndex", "ShardedDataset", "WindowedOrder"]
