"""Preference data as the chapter 7 bonus notebook (DPO) prepares it: pairs, splits, and the collate function.

Each record is an instruction of chapter 7's data with a `chosen` and a `rejected`
answer. The splits are chapter 7's, in file order. The dataset encodes the
prompt alone and each full text (prompt, response header, answer); the collate
function is the notebook's: both answers padded to the batch's longest + 1, and
a mask of the tokens whose log-probabilities count. That mask drops padding and,
with `mask_prompt`, the prompt's own tokens plus 2 (the notebook's cut: the two
newlines before "### Response:", so the header's tokens still count).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tiktoken
import torch
from torch.utils.data import Dataset

from gptlab.data.instruct import (
    RESPONSE_HEADER,
    SPLITS,
    format_input,
    read_records,
    split_records,
    validate_records,
)
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model.tokenizer import END_OF_TEXT_ID

SUBDIR = "preference"
FIELDS = ("instruction", "input", "output", "chosen", "rejected")
ANSWERS = ("chosen", "rejected")
# The notebook's cut: the prompt's tokens and the "\n\n" before "### Response:" (two tokens) leave the mask.
PROMPT_MASK_EXTRA = 2


def split_path(processed_dir: Path | str, split: str) -> Path:
    if split not in SPLITS:
        raise InputError(f"unknown preference split {split!r}; choose one of {list(SPLITS)}")
    return Path(processed_dir) / SUBDIR / f"{split}.json"


def load_split(processed_dir: Path | str, split: str) -> list[dict[str, str]]:
    """One prepared split as a list of records with FIELDS."""
    path = split_path(processed_dir, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro tokenize` first")
    return validate_records(json.loads(path.read_text(encoding="utf-8")), path, FIELDS)


def prepare(
    records_path: Path | str,
    processed_dir: Path | str,
    *,
    train_frac: float,
    test_frac: float,
    max_records: int | None = None,
) -> dict[str, int]:
    """Split the records in file order (chapter 7's split) and save each split; returns their sizes."""
    records = read_records(records_path, FIELDS)
    splits = split_records(records, train_frac=train_frac, test_frac=test_frac, max_records=max_records)
    for name, part in splits.items():
        with atomic_path(split_path(processed_dir, name)) as tmp:
            tmp.write_text(json.dumps(part, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {f"{name}_records": len(part) for name, part in splits.items()}


class PreferenceDataset(Dataset):
    """Items {prompt, chosen, rejected}: token ids of the prompt alone and of each full text, encoded once."""

    def __init__(self, records: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding) -> None:
        self.records = list(records)
        prompts = [format_input(entry) for entry in self.records]

        def encode(texts: list[str]) -> list[list[int]]:
            # disallowed_special=(): "<|endoftext|>" inside user text is plain text, never the stop token.
            return tokenizer.encode_batch(texts, disallowed_special=())

        self.prompts = encode(prompts)
        self.answers = {
            key: encode([p + RESPONSE_HEADER + e[key] for p, e in zip(prompts, self.records, strict=True)])
            for key in ANSWERS
        }

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        return {"prompt": self.prompts[idx], **{key: self.answers[key][idx] for key in ANSWERS}}


def preference_collate(
    batch: Sequence[dict[str, list[int]]],
    *,
    pad_token_id: int = END_OF_TEXT_ID,
    allowed_max_length: int | None = 1024,
    mask_prompt: bool = True,
) -> dict[str, torch.Tensor]:
    """The notebook's collate: {chosen, rejected} LongTensor[b, t] and {chosen_mask, rejected_mask} bool[b, t].

    Both answers are padded to one length, the longest of either + 1; a mask is True on an
    answer's own tokens, minus the prompt + PROMPT_MASK_EXTRA with `mask_prompt`; all four
    are then cut to `allowed_max_length`.
    """
    assert batch, "preference_collate needs at least one example"
    length = max(len(item[key]) + 1 for key in ANSWERS for item in batch)
    out: dict[str, torch.Tensor] = {}
    for key in ANSWERS:
        ids, masks = [], []
        for item in batch:
            sequence = item[key]
            mask = torch.zeros(length, dtype=torch.bool)
            mask[: len(sequence)] = True
            if mask_prompt:
                mask[: len(item["prompt"]) + PROMPT_MASK_EXTRA] = False
            ids.append(torch.tensor(sequence + [pad_token_id] * (length - len(sequence))))
            masks.append(mask)
        out[key] = torch.stack(ids)[:, :allowed_max_length]  # (b, t)
        out[f"{key}_mask"] = torch.stack(masks)[:, :allowed_max_length]  # (b, t)
    return out
