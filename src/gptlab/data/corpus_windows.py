"""Training windows over token shards: a corpus larger than RAM, read through memory maps.

The book's GPTDatasetV1 slices windows from one tensor of the whole text; here the
same windows are sliced from each shard's memory map as they are read, so a
process holds only the batches in flight, whatever the corpus size, and every
torchrun process opens the shards itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from gptlab.data.token_shards import read_shard
from gptlab.errors import InputError


class ShardWindows(Dataset):
    """Windows of `max_length` ids, `stride` apart, targets shifted by one, over every shard in order.

    Within a shard, windows start where GPTDatasetV1's would (`range(0, tokens - max_length,
    stride)`); none crosses into the next shard, so a shard's last tail of up to `stride`
    tokens is never an input.
    """

    def __init__(self, paths: Sequence[Path], max_length: int, stride: int) -> None:
        if max_length <= 0 or stride <= 0:
            raise InputError(f"max_length and stride must be positive, got {max_length} and {stride}")
        self.max_length, self.stride = max_length, stride
        self.shards = [read_shard(Path(path)) for path in paths]
        counts = [len(range(0, len(ids) - max_length, stride)) for ids in self.shards]
        self.first_window = np.cumsum([0, *counts])  # window index where each shard's windows begin
        if not len(self):
            raise InputError(
                f"{paths[0].parent if paths else 'no shards'}: no shard holds one window of "
                f"max_length={max_length} plus its shifted target: use a smaller max_length (or more text)"
            )

    def __len__(self) -> int:
        return int(self.first_window[-1])

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"window {idx} of {len(self)}")
        shard = int(np.searchsorted(self.first_window, idx, side="right")) - 1
        start = (idx - int(self.first_window[shard])) * self.stride
        # Copies one window (max_length + 1 ids) out of the memory map: the page cache holds the rest.
        window = torch.from_numpy(self.shards[shard][start : start + self.max_length + 1].astype(np.int64))
        return window[:-1], window[1:]


def spread_sample(dataset: Dataset, count: int) -> Dataset:
    """`count` windows spread evenly over `dataset` (all of them if it holds fewer): a fixed sample.

    Evaluations read the same windows every time, from every part of the split, so losses
    at different tokens seen compare like with like.
    """
    total = len(dataset)  # type: ignore[arg-type]
    if count >= total:
        return dataset
    return Subset(dataset, np.linspace(0, total - 1, count).round().astype(int).tolist())
