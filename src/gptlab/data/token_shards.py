"""Token shards: a corpus larger than RAM as uint16 files, written as a stream and read through a memory map.

GPT-2's 50,257 ids fit in 16 bits, half the bytes of the int32 `.npy` splits the book's
small datasets use. Each shard is a 32-byte header (magic, format version, header size,
token count) followed by the ids, little-endian; a reader checks all four against the
file's size, so a truncated or foreign file is one line naming it, never garbage tokens.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from gptlab.errors import InputError
from gptlab.files import atomic_path

MAGIC = b"GPTLABTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, header bytes, token count, padding to 32 bytes
TOKEN_DTYPE = np.dtype("<u2")
SUFFIX = ".bin"
_REBUILD = "rerun `dvc repro tokenize` to rebuild it"


def write_shard(path: Path, token_ids: np.ndarray) -> Path:
    """Write one shard atomically: a crash leaves the previous file or none, never half of one."""
    ids = np.asarray(token_ids)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError(f"{path}: token ids must fit in uint16, got {ids.min()}..{ids.max()}")
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        fh.write(HEADER.pack(MAGIC, VERSION, HEADER.size, ids.size))
        fh.write(np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).data)  # no copy of a shard's ids
    return path


def read_shard(path: Path) -> np.ndarray:
    """The shard's ids as a read-only memory map: the operating system pages them in as windows are read."""
    try:
        with path.open("rb") as fh:
            header = fh.read(HEADER.size)
    except FileNotFoundError:
        raise InputError(f"{path}: token shard not found; {_REBUILD}") from None
    if len(header) < HEADER.size:
        raise InputError(
            f"{path}: not a token shard (shorter than its {HEADER.size}-byte header); {_REBUILD}"
        )
    magic, version, header_bytes, count = HEADER.unpack(header)
    if magic != MAGIC:
        raise InputError(f"{path}: not a token shard (magic {magic!r}); {_REBUILD}")
    if version != VERSION or header_bytes != HEADER.size:
        raise InputError(f"{path}: token shard format {version}, this gptlab reads {VERSION}; {_REBUILD}")
    expected = HEADER.size + count * TOKEN_DTYPE.itemsize
    size = path.stat().st_size
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise InputError(f"{path}: {state} ({size} bytes, expected {expected}); {_REBUILD}")
    if count == 0:  # a memory map cannot be empty
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER.size, shape=(count,))


class ShardWriter:
    """Appends token ids and cuts them into shards of `shard_tokens` ids: `<prefix>-00000.bin`, `-00001`, ...

    Memory stays at one shard's ids whatever the corpus size. `close()` writes the last,
    shorter shard and returns every shard's path in order.
    """

    def __init__(self, directory: Path, prefix: str, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.directory, self.prefix, self.shard_tokens = Path(directory), prefix, shard_tokens
        self.paths: list[Path] = []
        self.tokens_written = 0
        self._buffer = np.empty(shard_tokens, dtype=TOKEN_DTYPE)
        self._filled = 0

    def write(self, token_ids: Iterable[int] | np.ndarray) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        while ids.size:
            room = self.shard_tokens - self._filled
            take = ids[:room]
            if take.size and (take.min() < 0 or take.max() > np.iinfo(TOKEN_DTYPE).max):
                raise ValueError(f"token ids must fit in uint16, got {take.min()}..{take.max()}")
            self._buffer[self._filled : self._filled + take.size] = take
            self._filled += take.size
            ids = ids[room:]
            if self._filled == self.shard_tokens:
                self._flush()

    def close(self) -> list[Path]:
        if self._filled or not self.paths:
            self._flush()
        return self.paths

    def _flush(self) -> None:
        path = self.directory / f"{self.prefix}-{len(self.paths):05d}{SUFFIX}"
        write_shard(path, self._buffer[: self._filled])
        self.paths.append(path)
        self.tokens_written += self._filled
        self._filled = 0


def shard_paths(directory: Path, prefix: str) -> list[Path]:
    """A split's shards in order; none is an InputError naming the folder."""
    paths = sorted(Path(directory).glob(f"{prefix}-*{SUFFIX}"))
    if not paths:
        raise InputError(f"{directory}: no {prefix} token shards ({prefix}-*{SUFFIX}); {_REBUILD}")
    return paths
