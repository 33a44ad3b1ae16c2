"""The three datasets of the book, prepared by the tokenize stage and read back by training.

verdict: The Verdict as token ids, in sliding windows for next-token pretraining (chapters 2 and 5).
spam: the SMS Spam Collection, balanced and padded for classification (chapter 6).
instruct: Alpaca-style instruction records and their collate function (chapter 7).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gptlab.errors import InputError
from gptlab.model.config import GPT2_VOCAB_SIZE

_NPY_MAGIC = b"\x93NUMPY"


def load_token_ids(path: Path) -> np.ndarray:
    """The integer array of a `.npy` file the tokenize stage wrote; never unpickles anything.

    A file that is not a NumPy array, holds pickled (object) data, non-integer values or
    ids outside GPT-2's vocabulary (which the embedding would meet as an IndexError mid-run),
    or is truncated, is an InputError naming it and how to rebuild it.
    """
    rebuild = "rerun `dvc repro tokenize` (or `dvc checkout`) to rebuild it"
    with path.open("rb") as fh:
        if fh.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise InputError(f"{path}: not a NumPy .npy file; {rebuild}")
        fh.seek(0)
        try:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
        except ValueError as exc:
            raise InputError(f"{path}: damaged .npy header ({exc}); {rebuild}") from exc
        data_start = fh.tell()
    if dtype.hasobject:
        raise InputError(f"{path}: holds pickled (object) data, which is never loaded; {rebuild}")
    if not np.issubdtype(dtype, np.integer):
        raise InputError(f"{path}: holds {dtype} values, expected integer token ids; {rebuild}")
    expected = data_start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise InputError(f"{path}: {state} ({size} bytes, expected {expected}); {rebuild}")
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as exc:  # anything the checks above did not foresee
        raise InputError(f"{path}: not a readable .npy file ({exc}); {rebuild}") from exc
    outside = (ids < 0) | (ids >= GPT2_VOCAB_SIZE)
    if outside.any():
        where = tuple(int(i) for i in np.argwhere(outside)[0])
        raise InputError(
            f"{path}: token id {ids[where]} at index {where[0] if len(where) == 1 else where} is outside "
            f"GPT-2's vocabulary (0 to {GPT2_VOCAB_SIZE - 1}); {rebuild}"
        )
    return ids
