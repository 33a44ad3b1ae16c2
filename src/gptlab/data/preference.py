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

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tiktoken
import torch
from torch.utils.data import Dataset

from gptlab.data.config import PreferenceSplit
from gptlab.data.instruct import (
    RESPONSE_HEADER,
    SPLITS,
    format_input,
    read_labelled,
    require_nonempty_splits,
    split_records,
    validate_records,
)
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model.config import MAX_CONTEXT_LENGTH
from gptlab.model.tokenizer import END_OF_TEXT_ID

SUBDIR = "preference"
FIELDS = ("instruction", "input", "output", "chosen", "rejected")
ANSWERS = ("chosen", "rejected")
# The notebook's cut: the prompt's tokens and the "\n\n" before "### Response:" (two tokens) leave the mask.
PROMPT_MASK_EXTRA = 2
# Why tokenize drops a pair (its counts in reports/tokenize/counts.json), and how many are named per reason.
EMPTY, IDENTICAL, TOO_LONG = "empty_answer", "chosen_equals_rejected", "too_long"
SHOWN = 5


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


class Pairs(NamedTuple):
    """The pairs split in file order (`total`: how many the file held) and those dropped, by reason."""

    total: int
    splits: dict[str, list[dict[str, str]]]
    dropped: dict[str, list[str]]


def read_splits(
    cfg: PreferenceSplit,
    path: Path | str,
    tokenizer: tiktoken.Encoding,
    *,
    book: bool,
    key: str = "tokenize.preference",
) -> Pairs:
    """The pairs of `path` (cfg.records_path), the `degenerate` ones dropped, split and checked before any write.

    A record without `output` gets its chosen answer as the reference the test answers are shown against.
    """
    names = dataclasses.asdict(cfg.fields)
    records, labels = read_labelled(path, FIELDS, names=names, optional={"input": "", "output": ""})
    for record in records:
        record["output"] = record["output"] or record["chosen"]
    reasons = degenerate(records, tokenizer, keep_identical=book)
    dropped: dict[str, list[str]] = {}
    for label, reason in zip(labels, reasons, strict=True):
        if reason is not None:
            dropped.setdefault(reason, []).append(label)
    kept = [record for record, reason in zip(records, reasons, strict=True) if reason is None]
    splits = split_records(
        kept, train_frac=cfg.train_frac, test_frac=cfg.test_frac, max_records=cfg.max_records
    )
    require_nonempty_splits(splits, path, key)
    return Pairs(len(records), splits, dropped)


def degenerate(
    records: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding, *, keep_identical: bool = False
) -> list[str | None]:
    """Why each pair teaches DPO nothing (None: it is sound).

    An empty answer; a chosen answer equal to the rejected one (its loss is log 2 whatever
    the model does: kept with `keep_identical`, as the notebook trains on the 6 of its file);
    a text longer than the longest context any model here has (MAX_CONTEXT_LENGTH tokens),
    whose answer no model would ever see whole.
    """
    prompts = [format_input(entry) + RESPONSE_HEADER for entry in records]
    lengths = {
        key: [
            len(ids)
            for ids in tokenizer.encode_batch(
                [p + e[key] for p, e in zip(prompts, records, strict=True)], disallowed_special=()
            )
        ]
        for key in ANSWERS
    }
    reasons: list[str | None] = []
    for i, entry in enumerate(records):
        if not entry["chosen"].strip() or not entry["rejected"].strip():
            reasons.append(EMPTY)
        elif entry["chosen"] == entry["rejected"] and not keep_identical:
            reasons.append(IDENTICAL)
        elif max(lengths[key][i] for key in ANSWERS) > MAX_CONTEXT_LENGTH:
            reasons.append(TOO_LONG)
        else:
            reasons.append(None)
    return reasons


def write_splits(pairs: Pairs, processed_dir: Path | str) -> dict[str, Any]:
    """Save each split; returns the counts: records read, dropped by reason, and each split's size."""
    for name, part in pairs.splits.items():
        with atomic_path(split_path(processed_dir, name)) as tmp:
            tmp.write_text(json.dumps(part, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {
        "records": pairs.total,
        "dropped": {reason: len(pairs.dropped.get(reason, [])) for reason in (EMPTY, IDENTICAL, TOO_LONG)},
        **{name: {"records": len(part)} for name, part in pairs.splits.items()},
    }


def describe_dropped(pairs: Pairs, path: Path | str) -> str | None:
    """One line naming the dropped pairs (the first few of each reason), or None when none was."""
    if not pairs.dropped:
        return None
    shown = []
    for reason, labels in pairs.dropped.items():
        more = f" and {len(labels) - SHOWN} more" if len(labels) > SHOWN else ""
        shown.append(f"{reason.replace('_', ' ')}: {', '.join(labels[:SHOWN])}{more}")
    count = sum(len(labels) for labels in pairs.dropped.values())
    return f"{path}: {count} of {pairs.total} preference pairs dropped ({'; '.join(shown)})"


class PreferenceDataset(Dataset):
    """Items {prompt, chosen, rejected}: token ids of the prompt alone and of each full text, encoded once."""

    def __init__(self, records: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding) -> None:
        self.records = list(records)
        prompts = [format_input(entry) for entry in self.records]

        def encode(texts: list[str]) -> list[list[int]]:
            # disallowed_special=(): "<|endoftext|>" inside user text is plain text, never the stop token.
            return tokenizer.encode_batch(texts, disallowed_special=())

        self.prompts = encode(prompts)
        # Where each answer starts: the prompt with its response header (allowed_max_length must pass it).
        self.prompt_lengths = [len(ids) for ids in encode([p + RESPONSE_HEADER for p in prompts])]
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
