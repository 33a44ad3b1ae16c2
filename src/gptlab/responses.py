"""Answers of an instruction-tuned model, and how close they are to the references.

As in chapter 7, the model is given the Alpaca prompt up to and including the
input (`format_input`) and writes the "### Response:" header itself; the answer
is what follows that header, up to the end-of-text token. Decoding is greedy
with the KV cache, so answers are reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import tiktoken
from rouge_score import rouge_scorer
from tqdm import tqdm

from gptlab.datasets.instruct import RESPONSE_HEADER, format_input
from gptlab.generate import generate
from gptlab.model import GPTModel
from gptlab.tokenizer import END_OF_TEXT_ID, text_to_token_ids, token_ids_to_text


def extract_response(generated_text: str, prompt: str) -> str:
    """The answer alone: `generated_text` without the prompt, the response header and surrounding whitespace."""
    assert generated_text.startswith(prompt), "generated text must begin with its prompt"
    answer = generated_text[len(prompt) :].strip()
    return answer.removeprefix(RESPONSE_HEADER.strip()).strip()  # the model writes the header itself


def generate_response(
    model: GPTModel, tokenizer: tiktoken.Encoding, entry: Mapping[str, str], *, max_new_tokens: int
) -> str:
    """The model's greedy answer to one instruction record, stopping at end-of-text."""
    prompt = format_input(entry)
    ids = text_to_token_ids(prompt, tokenizer)  # (1, t)
    out = generate(model, ids, max_new_tokens, eos_id=END_OF_TEXT_ID, use_cache=True)  # (1, t + n)
    return extract_response(token_ids_to_text(out, tokenizer), prompt)


def generate_responses(
    model: GPTModel,
    tokenizer: tiktoken.Encoding,
    records: Iterable[Mapping[str, str]],
    *,
    max_new_tokens: int,
) -> list[dict[str, str]]:
    """Each record (instruction, input, output) with the model's answer added as `model_response`."""
    records = list(records)
    return [
        {
            "instruction": record["instruction"],
            "input": record["input"],
            "output": record["output"],
            "model_response": generate_response(model, tokenizer, record, max_new_tokens=max_new_tokens),
        }
        for record in tqdm(records, desc="answering", unit="record")
    ]


def rouge_l(references: Iterable[str], responses: Iterable[str]) -> list[float]:
    """ROUGE-L F1 of each response against its reference (words Porter-stemmed, so 'runs' matches 'running')."""
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [
        scorer.score(reference, response)["rougeL"].fmeasure
        for reference, response in zip(references, responses, strict=True)
    ]
