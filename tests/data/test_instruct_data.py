"""Chapter 7's data: the Alpaca prompt, the file-order split, and the collate function's masking."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import tiktoken
import torch
from torch.utils.data import DataLoader

from gptlab.data.instruct import (
    InstructionDataset,
    format_input,
    format_prompt,
    instruction_collate,
    load_split,
    read_records,
    save_split,
    split_records,
)

PAD = 50256
IGN = -100


@pytest.fixture(scope="module")
def records(shared_data: Path) -> list[dict[str, str]]:
    return read_records(shared_data / "instruction-data.json")


def test_prompt_with_input(records: list[dict[str, str]]) -> None:
    # The book's printout of record 50.
    entry = records[50]
    assert format_input(entry) + f"\n\n### Response:\n{entry['output']}" == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n"
        "### Instruction:\nIdentify the correct spelling of the following word.\n\n"
        "### Input:\nOcassion\n\n"
        "### Response:\nThe correct spelling is 'Occasion.'"
    )


def test_prompt_without_input(records: list[dict[str, str]]) -> None:
    # Record 999 has an empty input: no Input section at all.
    entry = records[999]
    assert format_prompt(entry) == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n"
        "### Instruction:\nWhat is an antonym of 'complicated'?\n\n"
        "### Response:\n"
    )
    assert format_prompt(entry) == format_input(entry) + "\n\n### Response:\n"


def test_split_in_file_order(records: list[dict[str, str]], tmp_path: Path) -> None:
    assert len(records) == 1_100
    splits = split_records(records, train_frac=0.85, test_frac=0.1)
    assert {name: len(part) for name, part in splits.items()} == {"train": 935, "val": 55, "test": 110}
    assert splits["train"] == records[:935]
    assert splits["test"] == records[935:1045]
    assert splits["val"] == records[1045:]
    small = split_records(records, train_frac=0.85, test_frac=0.1, max_records=3)
    assert small == {name: part[:3] for name, part in splits.items()}
    for name, part in small.items():
        save_split(tmp_path, name, part)
        assert load_split(tmp_path, name) == part


def test_bad_records_are_named(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c"}]))
    with pytest.raises(ValueError, match="record 1"):
        read_records(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_records(path)
    with pytest.raises(FileNotFoundError, match="dvc repro tokenize"):
        load_split(tmp_path, "train")


def test_collate_as_the_book() -> None:
    # The book's example batch: three examples of 5, 2 and 3 tokens.
    batch = [([0, 1, 2, 3, 4], 2), ([5, 6], 1), ([7, 8, 9], 2)]
    inputs, targets = instruction_collate(batch)
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.tolist() == [[0, 1, 2, 3, 4], [5, 6, PAD, PAD, PAD], [7, 8, 9, PAD, PAD]]
    assert targets.tolist() == [[1, 2, 3, 4, PAD], [6, PAD, IGN, IGN, IGN], [8, 9, PAD, IGN, IGN]]


def test_collate_masks_the_prompt() -> None:
    batch = [([0, 1, 2, 3, 4], 3), ([5, 6], 1), ([7, 8, 9], 2)]
    inputs, targets = instruction_collate(batch, mask_prompt=True)
    assert inputs.tolist() == [[0, 1, 2, 3, 4], [5, 6, PAD, PAD, PAD], [7, 8, 9, PAD, PAD]]
    # Targets that predict prompt tokens 1..prompt_len-1 are hidden; the first response token is kept.
    assert targets.tolist() == [[IGN, IGN, 3, 4, PAD], [6, PAD, IGN, IGN, IGN], [IGN, 9, PAD, IGN, IGN]]


def test_collate_truncates_and_keeps_real_end_of_text_ids() -> None:
    batch = [([0, 1, 2, 3, 4], 2), ([3, PAD, 6], 1)]
    inputs, targets = instruction_collate(batch, allowed_max_length=4, ignore_index=-1)
    assert inputs.tolist() == [[0, 1, 2, 3], [3, PAD, 6, PAD]]
    # A 50256 inside an example's own tokens stays a target (the book's `== pad` test would
    # hide its end-of-text instead); only the padding after the end-of-text is masked.
    assert targets.tolist() == [[1, 2, 3, 4], [PAD, 6, PAD, -1]]
    untruncated, _ = instruction_collate(batch, allowed_max_length=None)
    assert untruncated.shape == (2, 5)


def test_dataset_on_real_records(records: list[dict[str, str]], tokenizer: tiktoken.Encoding) -> None:
    subset = [records[50], records[999], records[0]]
    ds = InstructionDataset(subset, tokenizer)
    for (ids, prompt_len), entry in zip(ds, subset, strict=True):
        assert ids == tokenizer.encode(format_prompt(entry) + entry["output"])
        assert ids[:prompt_len] == tokenizer.encode(format_prompt(entry))
        assert tokenizer.decode(ids[prompt_len:]) == entry["output"]
    loader = DataLoader(ds, batch_size=3, collate_fn=partial(instruction_collate, mask_prompt=True))
    inputs, targets = next(iter(loader))
    longest = max(len(ids) for ids, _ in ds)
    assert inputs.shape == targets.shape == (3, longest)
    for row, (ids, prompt_len) in enumerate(ds):
        kept = (targets[row] != IGN).nonzero().flatten().tolist()
        # Trained on: every response token, then exactly one end-of-text.
        assert kept == list(range(prompt_len - 1, len(ids)))
        assert targets[row, kept].tolist() == ids[prompt_len:] + [PAD]
