"""The Verdict: a 90/10 character split, its token ids, and the book's sliding-window dataset."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
import torch
from torch.utils.data import Dataset

from gptlab.data.token_ids import load_token_ids
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model.tokenizer import END_OF_TEXT

SUBDIR = "verdict"
SPLITS = ("train", "val")


def split_text(text: str, train_ratio: float) -> tuple[str, str]:
    """Split by characters as chapter 5 does: the first `train_ratio` of the text trains."""
    if not 0.0 < train_ratio < 1.0:
        raise InputError(f"tokenize.verdict.train_ratio: expected a value in (0, 1), got {train_ratio}")
    split_idx = int(train_ratio * len(text))
    return text[:split_idx], text[split_idx:]


def encode(text: str, tokenizer: tiktoken.Encoding) -> np.ndarray:
    """Token ids as int32 (GPT-2's 50,257 ids fit; half the size of int64 on disk)."""
    return np.asarray(tokenizer.encode(text, allowed_special={END_OF_TEXT}), dtype=np.int32)


def split_path(processed_dir: Path | str, split: str) -> Path:
    if split not in SPLITS:
        raise InputError(f"unknown Verdict split {split!r}; choose one of {list(SPLITS)}")
    return Path(processed_dir) / SUBDIR / f"{split}.npy"


def save_split(processed_dir: Path | str, split: str, token_ids: np.ndarray) -> Path:
    path = split_path(processed_dir, split)
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        np.save(fh, token_ids.astype(np.int32, copy=False))
    return path


def load_split(processed_dir: Path | str, split: str) -> np.ndarray:
    """The int32 token ids of one split, as the tokenize stage wrote them."""
    path = split_path(processed_dir, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro tokenize` first")
    return load_token_ids(path)


class GPTDatasetV1(Dataset):
    """The book's GPTDatasetV1: windows of `max_length` ids, `stride` apart, targets shifted by one.

    Windows start at 0, stride, 2*stride, ... while a full target window still
    fits (the book's `range(0, len(ids) - max_length, stride)`); they are sliced
    lazily from one tensor instead of being materialised up front.
    """

    def __init__(self, token_ids: Sequence[int] | np.ndarray, max_length: int, stride: int) -> None:
        if max_length <= 0 or stride <= 0:
            raise InputError(f"max_length and stride must be positive, got {max_length} and {stride}")
        self.token_ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
        if self.token_ids.ndim != 1:
            raise InputError(f"token_ids: expected a flat sequence, got shape {tuple(self.token_ids.shape)}")
        if len(self.token_ids) <= max_length:
            raise InputError(
                f"{len(self.token_ids)} tokens cannot fill one window of max_length={max_length} "
                "plus its shifted target: use a smaller max_length (or more text)"
            )
        self.max_length = max_length
        self.stride = stride
        self.starts = range(0, len(self.token_ids) - max_length, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.starts[idx]
        input_ids = self.token_ids[start : start + self.max_length]
        target_ids = self.token_ids[start + 1 : start + self.max_length + 1]
        return input_ids, target_ids


def prepare(
    text_path: Path | str, processed_dir: Path | str, tokenizer: tiktoken.Encoding, train_ratio: float
) -> dict[str, Any]:
    """Split The Verdict by characters, encode both parts, save them; returns the counts."""
    text_path = Path(text_path)
    if not text_path.is_file():
        raise FileNotFoundError(f"{text_path} not found: run `dvc repro download` (or set GPTLAB_MIRROR)")
    parts = dict(zip(SPLITS, split_text(text_path.read_text(encoding="utf-8"), train_ratio), strict=True))
    metrics = {}
    for split, text in parts.items():
        ids = encode(text, tokenizer)
        save_split(processed_dir, split, ids)
        metrics[split] = {"chars": len(text), "tokens": len(ids)}
    return metrics
