"""The SMS Spam Collection prepared as chapter 6 does, and the dataset that reads it back.

Preparation: read with pandas (tab-separated, default quoting: 4,825 ham and
747 spam), undersample ham to the spam count, shuffle, split 70/10/20, encode,
and pad every message with <|endoftext|> to the longest training message;
validation and test messages are truncated to that same length.
pandas is imported by the functions that read and write frames, not with the module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import tiktoken
import torch
from torch.utils.data import Dataset

from gptlab.data.token_ids import load_token_ids
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model.tokenizer import END_OF_TEXT_ID, gpt2_tokenizer

if TYPE_CHECKING:
    import pandas as pd

SUBDIR = "spam"
SPLITS = ("train", "val", "test")
LABELS = {"ham": 0, "spam": 1}


@dataclass(frozen=True)
class SpamSplits:
    """Three frames with columns text, label (ham=0, spam=1)."""

    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame

    def items(self) -> list[tuple[str, pd.DataFrame]]:
        return [("train", self.train), ("val", self.val), ("test", self.test)]


def read_collection(path: Path | str) -> pd.DataFrame:
    """The raw collection as the book reads it: columns Label ("ham"/"spam") and Text."""
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro download` (or set GPTLAB_MIRROR)")
    df = pd.read_csv(path, sep="\t", header=None, names=["Label", "Text"])
    unknown = sorted(set(df["Label"]) - set(LABELS))
    if unknown:
        raise InputError(f"{path}: unexpected labels {unknown[:5]}; expected only {sorted(LABELS)}")
    if df["Text"].isna().any():
        row = int(df.index[df["Text"].isna()][0])
        raise InputError(f"{path}: row {row} has no message text")
    return df


def balance_and_split(
    df: pd.DataFrame, *, seed: int, train_frac: float, val_frac: float, max_rows: int | None = None
) -> SpamSplits:
    """The book's create_balanced_dataset + random_split, with labels mapped to 0/1.

    `max_rows` keeps only the first rows of each split, for smoke runs. The fractions and
    `max_rows` come checked by the params schema (`config.SpamSplit`).
    """
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    spam = df[df["Label"] == "spam"]
    ham_subset = df[df["Label"] == "ham"].sample(len(spam), random_state=seed)
    balanced = pd.concat([ham_subset, spam])
    balanced = balanced.assign(Label=balanced["Label"].map(LABELS))
    shuffled = balanced.sample(frac=1, random_state=seed).reset_index(drop=True)
    shuffled = pd.DataFrame({"text": shuffled["Text"], "label": shuffled["Label"].astype(np.int64)})
    train_end = int(len(shuffled) * train_frac)
    val_end = train_end + int(len(shuffled) * val_frac)
    parts = (shuffled[:train_end], shuffled[train_end:val_end], shuffled[val_end:])
    train, val, test = (part.head(max_rows) if max_rows else part for part in parts)
    return SpamSplits(*(part.reset_index(drop=True) for part in (train, val, test)))


def encode_texts(texts: list[str], tokenizer: tiktoken.Encoding) -> list[list[int]]:
    """Messages as ordinary text: a literal "<|endoftext|>" in an SMS is not the special token."""
    return tokenizer.encode_batch(texts, disallowed_special=())


def pad_ids(encoded: list[list[int]], max_length: int, pad_token_id: int = END_OF_TEXT_ID) -> np.ndarray:
    """(n, max_length) int32 matrix: each row truncated to max_length, then right-padded."""
    matrix = np.full((len(encoded), max_length), pad_token_id, dtype=np.int32)
    for row, ids in enumerate(encoded):
        ids = ids[:max_length]
        matrix[row, : len(ids)] = ids
    return matrix


def split_paths(processed_dir: Path | str, split: str) -> tuple[Path, Path]:
    """(csv, npy) paths of one split."""
    if split not in SPLITS:
        raise InputError(f"unknown spam split {split!r}; choose one of {list(SPLITS)}")
    base = Path(processed_dir) / SUBDIR
    return base / f"{split}.csv", base / f"{split}.npy"


def save_split(processed_dir: Path | str, split: str, frame: pd.DataFrame, ids: np.ndarray) -> None:
    assert len(frame) == len(ids), f"{split}: {len(frame)} rows but {len(ids)} encoded rows"
    csv_path, npy_path = split_paths(processed_dir, split)
    with atomic_path(csv_path) as tmp:
        frame[["text", "label"]].to_csv(tmp, index=False)
    with atomic_path(npy_path) as tmp, tmp.open("wb") as fh:
        np.save(fh, ids.astype(np.int32, copy=False))


def read_split_csv(path: Path) -> pd.DataFrame:
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    # keep_default_na=False: a message reading "NA" or "null" stays text, not a missing value.
    return pd.read_csv(path, dtype={"text": str, "label": np.int64}, keep_default_na=False)


class SpamDataset(Dataset):
    """One prepared split: items (input_ids LongTensor[max_length], label LongTensor scalar).

    Rows are padded with 50256 to `max_length`, the longest training message;
    `texts` and `labels` hold the messages and their classes (ham=0, spam=1).
    """

    def __init__(self, processed_dir: Path | str, split: str) -> None:
        csv_path, npy_path = split_paths(processed_dir, split)
        for path in (csv_path, npy_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: run `dvc repro tokenize` first")
        frame = read_split_csv(csv_path)
        ids = load_token_ids(npy_path)
        if ids.ndim != 2 or len(ids) != len(frame):
            raise InputError(
                f"{npy_path} holds shape {ids.shape} but {csv_path} has {len(frame)} rows: "
                "rerun `dvc repro tokenize`"
            )
        self.texts: list[str] = frame["text"].tolist()
        self.labels: list[int] = frame["label"].tolist()
        self.max_length: int = int(ids.shape[1])
        self.input_ids = torch.from_numpy(ids.astype(np.int64))  # (n, max_length)
        self.label_ids = torch.tensor(self.labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[idx], self.label_ids[idx]

    def reencode(self, tokenizer: tiktoken.Encoding, max_length: int) -> None:
        """Encode the messages again, each cut to `max_length` tokens and padded to it (in place).

        What the bonus script's SpamDataset does with a given max_length: a longer length keeps
        more of a validation or test message than the tokenize stage's cut to the longest
        training message did. `max_length` is spam.max_length as the params schema checked it
        (a positive number), or the base model's context length.
        """
        ids = pad_ids(encode_texts(self.texts, tokenizer), max_length)
        self.input_ids = torch.from_numpy(ids.astype(np.int64))  # (n, max_length)
        self.max_length = max_length


def fit_to_context(
    datasets: Mapping[str, SpamDataset],
    max_length: int | Literal["context"] | None,
    context_length: int,
    bpe_files: tuple[Path, Path],
    base_dir: Path,
) -> None:
    """The splits encoded again to `max_length` (spam.max_length) when it is set, in place, and
    checked against the `context_length` of the base model in `base_dir`."""
    if max_length is not None:
        length = context_length if max_length == "context" else max_length
        tokenizer = gpt2_tokenizer(*bpe_files)
        for dataset in datasets.values():
            dataset.reencode(tokenizer, length)
    padded = datasets["train"].max_length
    if padded > context_length:
        raise InputError(
            f"spam messages are padded to {padded} tokens but {base_dir} reads at most "
            f"{context_length}: use a base model with a longer context, or set spam.max_length "
            'to at most that ("context" pads to the model\'s context length)'
        )


def prepare(
    collection_path: Path | str,
    processed_dir: Path | str,
    tokenizer: tiktoken.Encoding,
    *,
    seed: int,
    train_frac: float,
    val_frac: float,
    max_rows: int | None = None,
) -> dict[str, Any]:
    """Balance, split, encode and pad the collection, save every split; returns counts and class balance."""
    raw = read_collection(collection_path)
    splits = balance_and_split(raw, seed=seed, train_frac=train_frac, val_frac=val_frac, max_rows=max_rows)
    encoded = {name: encode_texts(frame["text"].tolist(), tokenizer) for name, frame in splits.items()}
    if not encoded["train"]:
        raise InputError(
            f"tokenize.spam: train_frac={train_frac} leaves no training rows to size the padding by"
        )
    max_length = max(len(ids) for ids in encoded["train"])
    metrics: dict[str, Any] = {
        "raw": {
            "rows": len(raw),
            "ham": int((raw["Label"] == "ham").sum()),
            "spam": int((raw["Label"] == "spam").sum()),
        },
        "max_length": max_length,
    }
    for name, frame in splits.items():
        save_split(processed_dir, name, frame, pad_ids(encoded[name], max_length))
        lengths = [len(ids) for ids in encoded[name]]
        metrics[name] = {
            "rows": len(frame),
            "ham": int((frame["label"] == 0).sum()),
            "spam": int((frame["label"] == 1).sum()),
            "tokens": sum(min(n, max_length) for n in lengths),
            "truncated": sum(n > max_length for n in lengths),
        }
    return metrics
