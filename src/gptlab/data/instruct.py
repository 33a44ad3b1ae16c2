"""Instruction data as chapter 7 prepares it: Alpaca prompts, file-order splits, and the collate function.

The collate function is the book's custom_collate_fn: pad to the batch's
longest example plus one, keep one <|endoftext|> per example as the target
that teaches the model to stop, and hide the rest of the padding from the
loss with -100. `mask_prompt` (the book's exercise 7.2) also hides the prompt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tiktoken
import torch
from torch.utils.data import Dataset

from gptlab.data.config import InstructSplit
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model.tokenizer import END_OF_TEXT_ID

SUBDIR = "instruct"
SPLITS = ("train", "val", "test")
FIELDS = ("instruction", "input", "output")
PREAMBLE = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
RESPONSE_HEADER = "\n\n### Response:\n"
IGNORE_INDEX = -100


def format_input(entry: dict[str, str]) -> str:
    """The Alpaca prompt up to and including the input (omitted when empty), without the response header."""
    instruction_text = f"{PREAMBLE}\n\n### Instruction:\n{entry['instruction']}"
    input_text = f"\n\n### Input:\n{entry['input']}" if entry["input"] else ""
    return instruction_text + input_text


def format_prompt(entry: dict[str, str]) -> str:
    """What the model sees before it answers: format_input plus the response header."""
    return format_input(entry) + RESPONSE_HEADER


def validate_records(
    records: Any,
    source: Path | str,
    fields: tuple[str, ...] = FIELDS,
    *,
    names: Mapping[str, str] | None = None,
    optional: Mapping[str, str] | None = None,
    labels: Sequence[str] | None = None,
) -> list[dict[str, str]]:
    """The records as string dicts of `fields` (chapter 7's three by default); an InputError names the first bad one.

    `names` maps a field to the file's own name for it (params' `fields`); a field of `optional`
    that a record lacks (or holds null) gets that default ("" for `input`). `labels` name the
    records in errors ("line 3" of a JSONL file); "record i" (from 0) otherwise.
    """
    names = names or {}
    optional = {"input": ""} if optional is None else optional
    if not isinstance(records, list):
        raise InputError(f"{source}: expected a JSON list of records, got {type(records).__name__}")
    clean = []
    for i, record in enumerate(records):
        label = labels[i] if labels is not None else f"record {i}"
        if not isinstance(record, dict):
            raise InputError(
                f"{source}: {label} must be an object with fields {list(fields)}, got {record!r:.200}"
            )
        entry = {}
        for name in fields:
            key = names.get(name, name)
            value = record.get(key)
            if value is None and name in optional:
                value = optional[name]
            if not isinstance(value, str):
                mapped = f" (params name it for `{name}`)" if key != name else ""
                problem = f"has no field {key!r}" if value is None else f"has a non-string field {key!r}"
                raise InputError(f"{source}: {label} {problem}{mapped}; got {record!r:.200}")
            entry[name] = value
        clean.append(entry)
    return clean


def read_records(
    path: Path | str,
    fields: tuple[str, ...] = FIELDS,
    *,
    names: Mapping[str, str] | None = None,
    optional: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The records of a JSON list (the book's file) or a JSONL file (`.jsonl`: one record a line), checked."""
    return read_labelled(path, fields, names=names, optional=optional)[0]


def read_labelled(
    path: Path | str,
    fields: tuple[str, ...] = FIELDS,
    *,
    names: Mapping[str, str] | None = None,
    optional: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, str]], list[str]]:
    """read_records, with what names each record in a message: "record i" (from 0), or a JSONL file's "line n"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro download` (or set GPTLAB_MIRROR)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(
            f"{path}: line {line} is not UTF-8 (byte {exc.start}); save the file as UTF-8"
        ) from None
    if path.suffix == ".jsonl":
        records, labels = _jsonl_records(text, path)
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: not valid JSON ({exc})") from exc
        labels = [f"record {i}" for i in range(len(records))] if isinstance(records, list) else []
    checked = validate_records(records, path, fields, names=names, optional=optional, labels=labels)
    return checked, labels


def _jsonl_records(text: str, path: Path) -> tuple[list[Any], list[str]]:
    """One JSON value a line, blank lines skipped; each labelled by its line number."""
    records, labels = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{path}: line {number} is not valid JSON ({exc.msg}, column {exc.colno})"
            ) from None
        labels.append(f"line {number}")
    return records, labels


def split_records(
    records: list[dict[str, str]], *, train_frac: float, test_frac: float, max_records: int | None = None
) -> dict[str, list[dict[str, str]]]:
    """The book's split in file order: train first, then test, then the rest as validation.

    `max_records` keeps only the first records of each split, for smoke runs. The fractions
    and `max_records` come checked by the params schema (`config.InstructSplit`).
    """
    train_end = int(len(records) * train_frac)
    test_end = train_end + int(len(records) * test_frac)
    splits = {
        "train": records[:train_end],
        "val": records[test_end:],
        "test": records[train_end:test_end],
    }
    return {name: part[:max_records] if max_records else part for name, part in splits.items()}


def require_nonempty_splits(splits: Mapping[str, Sequence[Any]], source: Path | str, key: str) -> None:
    """Each split holds a record, or one line names the file, the split and the params that set it."""
    total = sum(len(part) for part in splits.values())
    for name, part in splits.items():
        if not part:
            raise InputError(
                f"{source}: the {name} split has 0 records (of {total}): add records or change "
                f"{key}.train_frac / {key}.test_frac"
            )


def split_path(processed_dir: Path | str, split: str) -> Path:
    if split not in SPLITS:
        raise InputError(f"unknown instruction split {split!r}; choose one of {list(SPLITS)}")
    return Path(processed_dir) / SUBDIR / f"{split}.json"


def save_split(processed_dir: Path | str, split: str, records: list[dict[str, str]]) -> Path:
    path = split_path(processed_dir, split)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def load_split(processed_dir: Path | str, split: str) -> list[dict[str, str]]:
    """One prepared split as a list of {instruction, input, output} records."""
    path = split_path(processed_dir, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro tokenize` first")
    return validate_records(json.loads(path.read_text(encoding="utf-8")), path)


class InstructionDataset(Dataset):
    """Items (token ids of prompt + response, number of prompt tokens), encoded once up front.

    The whole text is encoded in one piece, as the book does. The prompt length
    is that of format_prompt's own encoding: a prefix of the whole because GPT-2's
    pre-tokenizer splits after the header's final newline (all 1,100 of the
    book's records check out), though an output that itself starts with a line
    break could shift it by a token.
    """

    def __init__(self, records: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding) -> None:
        self.records = list(records)
        prompts = [format_prompt(entry) for entry in self.records]
        full_texts = [prompt + entry["output"] for prompt, entry in zip(prompts, self.records, strict=True)]
        # disallowed_special=(): "<|endoftext|>" inside user text is plain text, never the stop token.
        self.encoded = tokenizer.encode_batch(full_texts, disallowed_special=())
        self.prompt_lengths = [len(ids) for ids in tokenizer.encode_batch(prompts, disallowed_special=())]

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, idx: int) -> tuple[list[int], int]:
        return self.encoded[idx], self.prompt_lengths[idx]


def instruction_collate(
    batch: Sequence[tuple[list[int], int]],
    *,
    pad_token_id: int = END_OF_TEXT_ID,
    ignore_index: int = IGNORE_INDEX,
    allowed_max_length: int | None = 1024,
    mask_prompt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The book's custom_collate_fn: (inputs LongTensor[b, t], targets LongTensor[b, t]).

    Each example gets one end-of-text token and is padded to the batch's longest
    example + 1; inputs drop the last position and targets the first. Target
    positions after an example's own end-of-text are set to `ignore_index`
    (by position, so a real 50256 in the text would stay a target); with
    `mask_prompt`, so are the first prompt_len - 1 targets, the ones that
    predict prompt tokens. Both are then cut to `allowed_max_length`.
    """
    assert batch, "instruction_collate needs at least one example"
    batch_max_length = max(len(ids) + 1 for ids, _ in batch)
    inputs_lst, targets_lst = [], []
    for ids, prompt_len in batch:
        padded = list(ids) + [pad_token_id] * (batch_max_length - len(ids))
        inputs = torch.tensor(padded[:-1])
        targets = torch.tensor(padded[1:])
        # targets[len(ids) - 1] is the end-of-text the model must learn to emit; the rest is padding.
        targets[len(ids) :] = ignore_index
        if mask_prompt:
            targets[: max(prompt_len - 1, 0)] = ignore_index
        if allowed_max_length is not None:
            inputs = inputs[:allowed_max_length]
            targets = targets[:allowed_max_length]
        inputs_lst.append(inputs)
        targets_lst.append(targets)
    return torch.stack(inputs_lst), torch.stack(targets_lst)  # each (b, t)


class Records(NamedTuple):
    """A file's records split in file order; `total`: how many the file held."""

    total: int
    splits: dict[str, list[dict[str, str]]]


def read_splits(cfg: InstructSplit, path: Path | str, key: str = "tokenize.instruct") -> Records:
    """The records of `path` (cfg.records_path) split in file order, checked before anything is written."""
    records = read_records(path, names=dataclasses.asdict(cfg.fields))
    splits = split_records(
        records, train_frac=cfg.train_frac, test_frac=cfg.test_frac, max_records=cfg.max_records
    )
    require_nonempty_splits(splits, path, key)
    return Records(len(records), splits)


def write_splits(records: Records, processed_dir: Path | str, tokenizer: tiktoken.Encoding) -> dict[str, Any]:
    """Save each split; returns sizes and token lengths."""
    metrics: dict[str, Any] = {"records": records.total}
    for name, part in records.splits.items():
        save_split(processed_dir, name, part)
        lengths = [len(ids) for ids, _ in InstructionDataset(part, tokenizer)]
        metrics[name] = {"records": len(part), "tokens": sum(lengths), "max_tokens": max(lengths, default=0)}
    return metrics


def require_room(prompt_lengths: Mapping[str, Sequence[int]], allowed_max_length: int, key: str) -> None:
    """Refuse, before any work, a length that cuts a record's prompt (response header included) before its answer.

    Such a record trains on no answer token: DPO's mean log-probability of an empty answer is NaN.
    `prompt_lengths`: each split's prompt token counts; `key` names the param.
    """
    for split, lengths in prompt_lengths.items():
        for i, length in enumerate(lengths):
            if length + 1 > allowed_max_length:
                raise InputError(
                    f"{key}: {allowed_max_length} cannot hold a prompt and its answer: the {split} split's "
                    f"record {i} has a prompt of {length} tokens; set it to {length + 1} or more"
                )
