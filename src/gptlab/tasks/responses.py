"""Answers of an instruction-tuned model, and how close they are to the references.

As in chapter 7, the model is given the Alpaca prompt up to and including the
input (`format_input`) and writes the "### Response:" header itself; the answer
is what follows that header, up to the end-of-text token. Decoding is greedy
with the KV cache, so answers are reproducible.

`fit_to_context` makes one record fit a model's context for interactive use
(`gptlab chat`): a long input is cropped at its end, never the instruction or
the template, and the answer is capped at the room the context leaves.
`generate_responses` caps each answer the same way (`answer_room`): past the
context the window would slide, each further token would cost a forward pass
over the whole context, and the answer would no longer see its instruction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import tiktoken
import torch
from tqdm import tqdm

from gptlab.data.instruct import RESPONSE_HEADER, format_input
from gptlab.errors import InputError
from gptlab.model.generate import generate, generate_each
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import END_OF_TEXT, END_OF_TEXT_ID, text_to_token_ids, token_ids_to_text


def extract_response(generated_text: str, prompt: str) -> str:
    """The answer alone: `generated_text` without the prompt, the response header and surrounding whitespace."""
    assert generated_text.startswith(prompt), "generated text must begin with its prompt"
    answer = generated_text[len(prompt) :].strip()
    return answer.removeprefix(RESPONSE_HEADER.strip()).strip()  # the model writes the header itself


def generate_response(
    model: GPTModel,
    tokenizer: tiktoken.Encoding,
    entry: Mapping[str, str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 123,
) -> str:
    """The model's answer to one instruction record, stopping at end-of-text: greedy (temperature 0,
    as the stage answers), else sampled with `seed` in a fork of the RNG, so reruns answer the same."""
    prompt = format_input(entry)
    ids = text_to_token_ids(prompt, tokenizer)  # (1, t)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = generate(  # (1, t + n)
            model, ids, max_new_tokens, temperature=temperature, top_k=top_k, eos_id=END_OF_TEXT_ID
        )
    return extract_response(token_ids_to_text(out, tokenizer), prompt)


@dataclass(frozen=True)
class FittedPrompt:
    """A record whose prompt fits the context, and what was given up to make it fit."""

    entry: dict[str, str]
    max_new_tokens: int
    prompt_tokens: int
    input_tokens: int  # of the input as given
    input_tokens_kept: int  # fewer than input_tokens when the input was cropped

    @property
    def input_cropped(self) -> bool:
        return self.input_tokens_kept < self.input_tokens


def fit_to_context(
    tokenizer: tiktoken.Encoding, entry: Mapping[str, str], *, context_length: int, max_new_tokens: int
) -> FittedPrompt:
    """Crop `entry`'s input (at its end) and cap `max_new_tokens` so prompt + answer fit the context.

    The answer keeps the room asked for, up to half the context; a longer input gives way,
    keeping its first tokens. The instruction and the prompt template are never cropped: when
    they alone leave no room for an answer, that is an InputError. Afterwards `max_new_tokens` is
    capped at what the context leaves after the prompt, so generation never slides the window
    (which would drop the instruction) and always ends.
    """

    def prompt_tokens(input_text: str) -> int:
        text = format_input({**entry, "input": input_text})
        return len(tokenizer.encode(text, allowed_special={END_OF_TEXT}))

    input_ids = tokenizer.encode(entry["input"], allowed_special={END_OF_TEXT})

    def cropped(keep: int) -> str:
        return tokenizer.decode(input_ids[:keep]).rstrip("\ufffd")  # no half of a multi-byte character

    fixed = prompt_tokens(cropped(0))
    if fixed >= context_length:
        raise InputError(
            f"the instruction is {fixed} tokens with the prompt template, and the model's context is "
            f"{context_length} tokens: no room is left for an answer; shorten the instruction "
            "(a long text belongs in --input, which is cropped to fit)"
        )
    answer_room = min(max_new_tokens, context_length // 2, context_length - fixed)
    keep = len(input_ids)
    if prompt_tokens(entry["input"]) + answer_room > context_length:
        low, high = 0, len(input_ids)  # the most input tokens that still fit
        while low < high:
            middle = (low + high + 1) // 2
            if prompt_tokens(cropped(middle)) + answer_room <= context_length:
                low = middle
            else:
                high = middle - 1
        keep = low
        while keep > 0 and prompt_tokens(cropped(keep)) + answer_room > context_length:
            keep -= 1  # byte-pair merges across the cut are not quite monotonic
    fitted = {**entry, "input": cropped(keep) if keep < len(input_ids) else entry["input"]}
    used = prompt_tokens(fitted["input"])
    return FittedPrompt(
        entry=dict(fitted),
        max_new_tokens=min(max_new_tokens, context_length - used),
        prompt_tokens=used,
        input_tokens=len(input_ids),
        input_tokens_kept=keep,
    )


def prompt_ids(tokenizer: tiktoken.Encoding, records: Iterable[Mapping[str, str]]) -> list[list[int]]:
    """The token ids of each record's prompt (the Alpaca template up to its input), as the model reads it."""
    return [text_to_token_ids(format_input(record), tokenizer)[0].tolist() for record in records]


def answer_room(prompt_lengths: Sequence[int], *, context_length: int, max_new_tokens: int) -> list[int]:
    """The longest answer of each prompt: max_new_tokens, capped at what the context leaves after it (0 if none)."""
    return [max(0, min(max_new_tokens, context_length - length)) for length in prompt_lengths]


def generate_responses(
    model: GPTModel,
    tokenizer: tiktoken.Encoding,
    records: Iterable[Mapping[str, str]],
    *,
    max_new_tokens: int,
    batch_size: int = 1,
) -> list[dict[str, str]]:
    """Each record (instruction, input, output) with the model's answer added as `model_response`.

    Each answer is capped at the room the model's context leaves after its prompt
    (`answer_room`). batch_size 1 answers one record at a time, as the book does. More
    answers records of similar prompt lengths together (`generate_each`): the same
    greedy answers up to float rounding, which batching may change.
    """
    records = list(records)
    prompts = prompt_ids(tokenizer, records)
    rooms = answer_room(
        [len(p) for p in prompts], context_length=model.cfg.context_length, max_new_tokens=max_new_tokens
    )
    answers: list[str] = [""] * len(records)
    by_length = sorted(range(len(records)), key=lambda i: len(prompts[i]))  # little padding per batch
    with tqdm(total=len(records), desc="answering", unit="record") as progress:
        for start in range(0, len(records), batch_size):
            batch = by_length[start : start + batch_size]
            answered = _answer_batch(model, [prompts[i] for i in batch], [rooms[i] for i in batch])
            for i, answer in zip(batch, answered, strict=True):
                answers[i] = extract_response(tokenizer.decode(prompts[i] + answer), format_input(records[i]))
            progress.update(len(batch))
    return [
        {
            "instruction": record["instruction"],
            "input": record["input"],
            "output": record["output"],
            "model_response": answer,
        }
        for record, answer in zip(records, answers, strict=True)
    ]


def _answer_batch(model: GPTModel, prompts: list[list[int]], rooms: list[int]) -> list[list[int]]:
    """The greedy answer ids of each prompt, each at most its room; together where all get the same room."""
    if len(prompts) > 1 and len(set(rooms)) == 1 and rooms[0] > 0:  # then each prompt + room fits the context
        return generate_each(model, prompts, rooms[0], eos_id=END_OF_TEXT_ID)
    return [
        generate(model, torch.tensor([prompt]), room, eos_id=END_OF_TEXT_ID)[0, len(prompt) :].tolist()
        for prompt, room in zip(prompts, rooms, strict=True)
    ]


def rouge_l(references: Iterable[str], responses: Iterable[str]) -> list[float]:
    """ROUGE-L F1 of each response against its reference (words Porter-stemmed, so 'runs' matches 'running')."""
    # Imported here, after the answers are generated: rouge_score loads nltk, scipy and scikit-learn (~1 s).
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [
        scorer.score(reference, response)["rougeL"].fmeasure
        for reference, response in zip(references, responses, strict=True)
    ]
