"""Windows over token shards: the book's windows, per shard, read through memory maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gptlab.data.corpus_windows import ShardWindows, spread_sample
from gptlab.data.token_shards import ShardWriter
from gptlab.data.verdict import GPTDatasetV1
from gptlab.errors import InputError


def write_shards(tmp_path, tokens: int, shard_tokens: int) -> tuple[np.ndarray, list]:
    ids = np.random.default_rng(0).integers(0, 50257, size=tokens)
    writer = ShardWriter(tmp_path, "train", shard_tokens)
    writer.write(ids)
    return ids, writer.close()


@pytest.mark.parametrize("stride", [4, 3])
def test_each_shard_gives_the_books_windows_and_none_crosses_shards(tmp_path, stride) -> None:
    ids, paths = write_shards(tmp_path, tokens=50, shard_tokens=20)  # shards of 20, 20, 10 ids
    windows = ShardWindows(paths, max_length=4, stride=stride)
    expected = [
        GPTDatasetV1(ids[start : start + 20], 4, stride)[i]
        for start in (0, 20, 40)
        for i in range(len(GPTDatasetV1(ids[start : start + 20], 4, stride)))
    ]
    assert len(windows) == len(expected)
    for (x, y), (bx, by) in zip((windows[i] for i in range(len(windows))), expected, strict=True):
        assert x.dtype == torch.int64 and torch.equal(x, bx) and torch.equal(y, by)
    assert all(isinstance(shard, np.memmap) for shard in windows.shards)  # never read into RAM
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_shards_too_short_for_one_window_are_one_line(tmp_path) -> None:
    _, paths = write_shards(tmp_path, tokens=4, shard_tokens=20)
    with pytest.raises(InputError, match="max_length=4"):
        ShardWindows(paths, max_length=4, stride=4)


def test_the_fixed_sample_spreads_over_the_split_and_never_changes(tmp_path) -> None:
    _, paths = write_shards(tmp_path, tokens=401, shard_tokens=401)
    windows = ShardWindows(paths, max_length=4, stride=4)  # 100 windows
    sample = spread_sample(windows, 5)
    assert sample.indices == [0, 25, 50, 74, 99] == spread_sample(windows, 5).indices
    assert spread_sample(windows, 500) is windows
