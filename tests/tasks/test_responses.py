"""Answer generation and extraction, prompts fitted to the context, and the ROUGE-L score of answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gptlab.data.instruct import format_input, format_prompt
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import END_OF_TEXT_ID
from gptlab.tasks.responses import (
    answer_room,
    extract_response,
    fit_to_context,
    generate_response,
    generate_responses,
    prompt_ids,
    rouge_l,
)

ENTRY = {
    "instruction": "Name the capital of France.",
    "input": "",
    "output": "The capital of France is Paris.",
}
ENTRY_WITH_INPUT = {"instruction": "Correct the spelling.", "input": "Ocassion", "output": "Occasion"}


def test_extract_strips_prompt_header_and_whitespace() -> None:
    prompt = format_input(ENTRY)
    generated = prompt + "\n\n### Response:\nThe capital of France is Paris.\n  "
    assert extract_response(generated, prompt) == "The capital of France is Paris."
    assert extract_response(format_prompt(ENTRY) + "Paris.", prompt) == "Paris."


def test_extract_without_header_and_inner_header_kept() -> None:
    prompt = format_input(ENTRY_WITH_INPUT)
    assert extract_response(prompt + " Occasion", prompt) == "Occasion"
    inner = "Write '### Response:' above your answer."
    assert extract_response(prompt + "\n\n### Response:\n" + inner, prompt) == inner
    assert extract_response(prompt, prompt) == ""


def test_extract_refuses_text_without_its_prompt() -> None:
    with pytest.raises(AssertionError, match="begin with its prompt"):
        extract_response("something else entirely", format_input(ENTRY))


def constant_model(token_id: int) -> GPTModel:
    """A tiny GPT whose greedy choice is always `token_id`: the final norm outputs a fixed vector."""
    torch.manual_seed(0)
    model = build_gpt(ModelConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0))
    with torch.no_grad():
        model.final_norm.scale.zero_()
        model.final_norm.shift.zero_()
        model.final_norm.shift[0] = 1.0
        model.out_head.weight.zero_()
        model.out_head.weight[token_id, 0] = 1.0
    return model.eval()


def test_generate_response_decodes_only_the_answer(tokenizer) -> None:
    (yes,) = tokenizer.encode(" yes")
    answer = generate_response(constant_model(yes), tokenizer, ENTRY_WITH_INPUT, max_new_tokens=3)
    assert answer == "yes yes yes"


def test_generate_response_stops_at_end_of_text(tokenizer) -> None:
    answer = generate_response(constant_model(END_OF_TEXT_ID), tokenizer, ENTRY, max_new_tokens=5)
    assert answer == ""


def test_generate_responses_keeps_records_in_order(tokenizer) -> None:
    (ok,) = tokenizer.encode(" ok")
    records = [ENTRY, ENTRY_WITH_INPUT]
    answered = generate_responses(constant_model(ok), tokenizer, records, max_new_tokens=2)
    assert answered == [{**record, "model_response": "ok ok"} for record in records]


def test_answers_are_capped_at_the_room_the_context_leaves(tokenizer) -> None:
    """A base with context 64 asked for 256 new tokens: each answer ends where the context is full."""
    (ok,) = tokenizer.encode(" ok")
    no_room = {**ENTRY_WITH_INPUT, "input": "word " * 40}  # the prompt alone fills the context
    records = [ENTRY, ENTRY_WITH_INPUT, no_room]
    lengths = [len(ids) for ids in prompt_ids(tokenizer, records)]
    assert lengths[0] != lengths[1] and max(lengths[:2]) < 64 < lengths[2]
    assert answer_room(lengths, context_length=64, max_new_tokens=256) == [
        64 - lengths[0],
        64 - lengths[1],
        0,
    ]
    model = constant_model(ok)  # context 64, and it never ends an answer itself
    for batch_size in (1, 3):
        answered = generate_responses(model, tokenizer, records, max_new_tokens=256, batch_size=batch_size)
        assert [r["model_response"].split() for r in answered] == [["ok"] * (64 - n) for n in lengths[:2]] + [
            []
        ]


def test_the_books_answers_have_all_the_room_they_ask_for(shared_data: Path, tokenizer) -> None:
    """gpt2-medium's 1,024 positions hold every prompt of the book's data plus 256 new tokens: nothing is capped."""
    records = json.loads((shared_data / "instruction-data.json").read_text(encoding="utf-8"))
    lengths = [len(ids) for ids in prompt_ids(tokenizer, records)]
    assert len(lengths) == 1100
    assert answer_room(lengths, context_length=1024, max_new_tokens=256) == [256] * len(lengths)


def test_rouge_l() -> None:
    reference = "the cat sat on the mat"
    exact, partial, disjoint, stemmed = rouge_l(
        [reference] * 4, [reference, "the cat on the mat", "dogs bark loudly", "the cats sat on the mats"]
    )
    assert exact == pytest.approx(1.0)
    # Longest common subsequence 5 of 5 response and 6 reference words.
    precision, recall = 5 / 5, 5 / 6
    assert partial == pytest.approx(2 * precision * recall / (precision + recall))
    assert disjoint == 0.0
    assert stemmed == pytest.approx(1.0)  # cats/mats stem to cat/mat
    with pytest.raises(ValueError):
        rouge_l([reference], [])


def test_batched_answers_equal_one_by_one(tokenizer) -> None:
    torch.manual_seed(1)
    model = build_gpt(ModelConfig(context_length=96, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0)).eval()
    records = [ENTRY, ENTRY_WITH_INPUT, {**ENTRY, "instruction": "Say something."}, ENTRY_WITH_INPUT]
    one_by_one = generate_responses(model, tokenizer, records, max_new_tokens=12)
    assert len({r["model_response"] for r in one_by_one}) > 1  # the prompts get different answers
    assert generate_responses(model, tokenizer, records, max_new_tokens=12, batch_size=3) == one_by_one


CHAT_CONTEXT = 96


@pytest.mark.parametrize(
    "long_input",
    [
        " ".join(["naïve café 😀 ünïcödé"] * 100),
        "x" * 5000,
        "<|endoftext|> " * 200,
        "a\n\n### Response:\n" * 80,
    ],
    ids=["multi-byte", "one-long-word", "special-token", "fake-headers"],
)
def test_fit_to_context_crops_only_the_input(tokenizer: Any, long_input: str) -> None:
    entry = {"instruction": "Summarize the text.", "input": long_input, "output": ""}
    fitted = fit_to_context(tokenizer, entry, context_length=CHAT_CONTEXT, max_new_tokens=10)

    assert fitted.input_cropped and fitted.max_new_tokens == 10
    assert fitted.entry["instruction"] == entry["instruction"]
    assert long_input.startswith(fitted.entry["input"]) and "\ufffd" not in fitted.entry["input"]
    prompt = format_input(fitted.entry)
    ids = tokenizer.encode(prompt, allowed_special={"<|endoftext|>"})
    assert len(ids) == fitted.prompt_tokens and len(ids) + fitted.max_new_tokens <= CHAT_CONTEXT
    assert tokenizer.decode(ids) == prompt  # the answer is found after the prompt, as generate_response needs

    short = {**entry, "input": "A short text."}
    assert fit_to_context(tokenizer, short, context_length=1024, max_new_tokens=10).entry == short
