"""The shard formats ``ShardedDataset`` (training/data/dataset.py) reads, one module each, all through the same per-shard
index entries: its own three, token arrays (``tokens.py``), JSON Lines (``jsonl.py``) and Parquet (``parquet.py``), and
the formats other tools write, MosaicML Streaming's MDS (``mds.py``) and WebDataset tars (``webdataset.py``).

Each format is a ``ShardFormat`` (``base.py``): the file endings of its shards, its own arguments' checks and what the
index records of them, what it reads once per dataset (``prepare``: MDS's ``index.json``), a shard's sample count for
the product's index (``count``) and the most a shard's bytes can hold, and a reader of one shard by sample number
(``reader``). Adding a format is a module here and a row below; these modules import nothing from the dataset (it
imports them)."""

from __future__ import annotations

from training.data.formats.base import ShardFormat
from training.data.formats.jsonl import JSONL
from training.data.formats.mds import MDS
from training.data.formats.parquet import PARQUET
from training.data.formats.tokens import TOKENS
from training.data.formats.webdataset import WEBDATASET

SHARD_FORMATS: dict[str, ShardFormat] = {
    "tokens": TOKENS,
    "jsonl": JSONL,
    "parquet": PARQUET,
    "mds": MDS,
    "webdataset": WEBDATASET,
}

__all__ = ["SHARD_FORMATS", "ShardFormat"]
