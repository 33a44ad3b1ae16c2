"""Token shards: what is written reads back as the same ids, and a damaged shard is one line naming it."""

from __future__ import annotations

import numpy as np
import pytest

from gptlab.data.token_shards import HEADER, ShardWriter, read_shard, shard_paths, write_shard
from gptlab.errors import InputError


def test_a_stream_cut_into_shards_reads_back_in_order(tmp_path):
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 50257, size=n) for n in (3, 10, 0, 7, 25)]
    writer = ShardWriter(tmp_path, "train", shard_tokens=8)
    for piece in pieces:
        writer.write(piece)
    paths = writer.close()
    assert [p.name for p in paths] == [f"train-{i:05d}.bin" for i in range(6)]
    assert shard_paths(tmp_path, "train") == paths
    assert [len(read_shard(p)) for p in paths] == [8, 8, 8, 8, 8, 5]
    assert writer.tokens_written == 45
    np.testing.assert_array_equal(np.concatenate([read_shard(p) for p in paths]), np.concatenate(pieces))


def test_an_empty_stream_still_writes_one_empty_shard(tmp_path):
    paths = ShardWriter(tmp_path, "val", shard_tokens=8).close()
    assert len(paths) == 1 and len(read_shard(paths[0])) == 0


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:-2], "truncated"),
        (lambda raw: raw + b"\0\0", "longer than its header says"),
        (lambda raw: b"NOTASHRD" + raw[8:], "not a token shard"),
        (lambda raw: raw[:10], "shorter than its 32-byte header"),
        (lambda raw: raw[:8] + (2).to_bytes(4, "little") + raw[12:], "token shard format 2"),
    ],
)
def test_a_damaged_shard_is_one_line_naming_it(tmp_path, damage, message):
    path = write_shard(tmp_path / "train-00000.bin", np.arange(5))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(InputError, match=message) as caught:
        read_shard(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_ids_outside_uint16_are_refused_not_wrapped(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "x.bin", np.array([70000]))
    with pytest.raises(ValueError, match="uint16"):
        ShardWriter(tmp_path, "x", 4).write([1, -1])
    assert HEADER.size == 32


def test_no_shards_names_the_folder(tmp_path):
    with pytest.raises(InputError, match=str(tmp_path)):
        shard_paths(tmp_path, "train")
