"""The GPT recipe's recording test recipe (tests/recipes_for_tests.py) over MDS or WebDataset shards: each sample's
``tokens`` column (every token the sample's id, tests/format_data.py) is its (x, y), so a run records which samples
it was fed, read from the data itself."""

from __future__ import annotations

from typing import Any

import torch

from tests.recipes_for_tests import ShardRecordingGPT
from training.data import ShardedDataset

FORMAT_RECORDING = "tests.format_recipes:FormatRecordingGPT"
_COLUMN = {"mds": "tokens", "webdataset": "tokens.npy"}


class TokenColumn(ShardedDataset):
    """A ShardedDataset of MDS or WebDataset samples whose ``tokens`` column is the sample, as the GPT recipe's
    (x, y) blocks."""

    def __getitem__(self, i: int) -> Any:
        return self._blocks(super().__getitem__(i))

    def __getitems__(self, ids: list[int]) -> list[Any]:
        return [self._blocks(s) for s in super().__getitems__(ids)]

    def _blocks(self, sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.from_numpy(sample[_COLUMN[self.format]].astype("int64"))
        return tokens[:-1], tokens[1:]


class FormatRecordingGPT(ShardRecordingGPT):
    def __init__(self, data_format: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.data_format = data_format

    def _stream(self, url: str) -> Any:
        return TokenColumn(url, self.data_format, storage_options=self.data_options)
