"""The shard formats other tools write, read by ``ShardedDataset`` (training/data/shards.py) through the same per-shard
index entries as its own formats: MosaicML Streaming's MDS (``mds.py``) and WebDataset tars (``webdataset.py``).

Each format is a ``ShardFormat``: the file endings of its shards, what it reads once per dataset (``prepare``: MDS's
``index.json``), a shard's sample count for the product's index (``count``), and a reader of one shard by sample number
(``Reader``). These modules import nothing from shards.py (it imports them)."""

from __future__ import annotations

from training.data.formats.base import ShardFormat
from training.data.formats.mds import MDS
from training.data.formats.webdataset import WEBDATASET

OTHER_FORMATS: dict[str, ShardFormat] = {"mds": MDS, "webdataset": WEBDATASET}

__all__ = ["OTHER_FORMATS", "ShardFormat"]
