"""The DPO notebook's data: the pairs, chapter 7's split, and the collate function's masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptlab.data.config import PreferenceSplit
from gptlab.data.instruct import read_records
from gptlab.data.preference import (
    FIELDS,
    PreferenceDataset,
    load_split,
    preference_collate,
    read_splits,
    write_splits,
)
from gptlab.errors import InputError

PAD = 50256
SOURCE = "instruction-data-with-preference.json"


@pytest.fixture(scope="module")
def records(shared_data: Path) -> list[dict[str, str]]:
    return read_records(shared_data / SOURCE, FIELDS)


def test_split_in_file_order_as_the_notebook(records, tmp_path: Path, shared_data: Path, tokenizer) -> None:
    split = PreferenceSplit(train_frac=0.85, test_frac=0.1, max_records=None)
    counts = write_splits(read_splits(split, shared_data / SOURCE, tokenizer, book=True), tmp_path)
    # the notebook's printout; its 6 pairs whose answers are equal train as in the notebook
    assert {name: counts[name]["records"] for name in ("train", "val", "test")} == {
        "train": 935,
        "val": 55,
        "test": 110,
    }
    assert counts["dropped"] == {"empty_answer": 0, "chosen_equals_rejected": 0, "too_long": 0}
    assert load_split(tmp_path, "train") == records[:935]
    assert load_split(tmp_path, "test") == records[935:1045]
    assert load_split(tmp_path, "val") == records[1045:]
    # The notebook's printout of record 50.
    assert records[50]["rejected"] == "The correct spelling is obviously 'Occasion.'"


def test_collate_masks_the_prompt_plus_two_and_the_padding(records, tokenizer) -> None:
    dataset = PreferenceDataset(records[:2], tokenizer)
    batch = preference_collate([dataset[0], dataset[1]], allowed_max_length=None)
    longest = max(len(dataset[i][key]) for i in range(2) for key in ("chosen", "rejected"))
    for key in ("chosen", "rejected"):
        assert batch[key].shape == batch[f"{key}_mask"].shape == (2, longest + 1)
        for i in range(2):
            ids, prompt = dataset[i][key], dataset[i]["prompt"]
            assert batch[key][i, : len(ids)].tolist() == ids
            assert set(batch[key][i, len(ids) :].tolist()) == {PAD}
            mask = batch[f"{key}_mask"][i].tolist()
            assert mask == [False] * (len(prompt) + 2) + [True] * (len(ids) - len(prompt) - 2) + [False] * (
                longest + 1 - len(ids)
            )
            # What counts, as the notebook decodes it: the response header and the answer.
            kept = batch[key][i][batch[f"{key}_mask"][i]].tolist()
            assert tokenizer.decode(kept) == f"### Response:\n{records[i][key]}"


def test_collate_without_prompt_mask_and_cut_to_the_allowed_length(records, tokenizer) -> None:
    dataset = PreferenceDataset(records[:2], tokenizer)
    batch = preference_collate([dataset[0], dataset[1]], allowed_max_length=40, mask_prompt=False)
    for key in ("chosen", "rejected", "chosen_mask", "rejected_mask"):
        assert batch[key].shape == (2, 40)
    assert batch["chosen_mask"].all()  # 40 tokens of text, none of them padding, none masked


def test_a_record_without_an_answer_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b", "chosen": "c"}]))
    with pytest.raises(InputError, match=r"pairs.json: record 0 has no field 'rejected'"):
        read_records(path, FIELDS)
