"""Generation: the KV cache changes nothing but speed; sampling is seeded; filters and stopping work."""

from __future__ import annotations

import pytest
import torch

from gptlab.errors import InputError
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig, SampleConfig
from gptlab.model.generate import _top_p_filter, generate, generate_each, generate_text
from gptlab.model.gpt import GPTModel

from helpers import TINY_LM

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/model/conftest.py

NEW_TOKENS = 40  # greedy decoding: 5 + 40 > 32, so every prompt length slides the window
assert TINY_LM["context_length"] < 5 + NEW_TOKENS


@pytest.mark.parametrize("prompt_len", [5, 31, 45])  # short, one short of the context, past it
def test_cached_greedy_equals_uncached(model: GPTModel, prompt_len: int) -> None:
    idx = torch.randint(0, TINY_LM["vocab_size"], (2, prompt_len), generator=torch.Generator().manual_seed(2))
    # 40 new tokens run past the 32-token context even from the short prompt, so the window
    # slides with a cache too.
    cached = generate(model, idx, NEW_TOKENS, use_cache=True)
    uncached = generate(model, idx, NEW_TOKENS, use_cache=False)
    assert cached.shape == (2, prompt_len + NEW_TOKENS)
    assert torch.equal(cached, uncached)
    assert cached[:, prompt_len:].unique().numel() > 3  # a real continuation, not one repeated token


@pytest.mark.parametrize("stop_early", [False, True])
def test_batched_greedy_equals_one_prompt_at_a_time(model: GPTModel, stop_early: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, TINY_LM["vocab_size"], (n,), generator=gen).tolist() for n in (2, 9, 5, 12)]
    new_tokens = TINY_LM["context_length"] - 12  # the longest prompt fills the context: no sliding
    free = [generate(model, torch.tensor([p]), new_tokens)[0, len(p) :].tolist() for p in prompts]
    unused = min(set(range(TINY_LM["vocab_size"])) - {t for row in free for t in row})
    eos = free[1][4] if stop_early else unused  # a token some rows produce, or none does
    alone = [
        generate(model, torch.tensor([p]), new_tokens, eos_id=eos)[0, len(p) :].tolist() for p in prompts
    ]
    assert generate_each(model, prompts, new_tokens, eos_id=eos) == alone
    if stop_early:
        assert min(map(len, alone)) < new_tokens == max(map(len, alone))  # rows stop at different steps
    else:
        assert alone == free


def test_padded_rows_must_fit_the_context(model: GPTModel, prompts: torch.Tensor) -> None:
    with pytest.raises(InputError, match="must fit the context"):
        generate(model, prompts, TINY_LM["context_length"], pad=torch.zeros(3, dtype=torch.long))


def test_prompts_longer_than_the_context_are_cropped(model: GPTModel) -> None:
    idx = torch.randint(0, TINY_LM["vocab_size"], (1, 50), generator=torch.Generator().manual_seed(3))
    out = generate(model, idx, 1)
    cropped = generate(model, idx[:, -TINY_LM["context_length"] :], 1)
    assert torch.equal(out[:, :50], idx)
    assert out[0, -1] == cropped[0, -1]


def test_sampling_is_reproducible_with_a_seed(model: GPTModel, prompts: torch.Tensor) -> None:
    def sample(seed: int, use_cache: bool = True) -> torch.Tensor:
        torch.manual_seed(seed)
        return generate(model, prompts, 12, temperature=1.0, top_k=20, use_cache=use_cache)

    first = sample(123)
    assert torch.equal(first, sample(123))
    assert torch.equal(first, sample(123, use_cache=False))  # the cache draws the same random numbers
    assert not torch.equal(first, sample(124))
    assert not torch.equal(first, generate(model, prompts, 12))  # sampling differs from greedy


def test_top_k_one_tiny_top_p_and_tiny_temperature_are_greedy(model: GPTModel, prompts: torch.Tensor) -> None:
    greedy = generate(model, prompts, 15)
    torch.manual_seed(0)
    assert torch.equal(generate(model, prompts, 15, temperature=1e-5), greedy)  # scaling sharpens to argmax
    assert torch.equal(generate(model, prompts, 15, temperature=2.0, top_k=1), greedy)
    assert torch.equal(generate(model, prompts, 15, temperature=2.0, top_p=1e-6), greedy)


def test_top_k_samples_only_the_k_largest_logits_of_each_row(model: GPTModel, prompts: torch.Tensor) -> None:
    rows = prompts.repeat(100, 1)  # (300, 5): three distinct prompts, each sampled 100 times
    torch.manual_seed(0)
    picked = generate(model, rows, 1, temperature=5.0, top_k=3)[:, -1]
    with torch.no_grad():
        allowed = torch.topk(model(rows)[:, -1], 3).indices  # (300, 3)
    assert (picked.unsqueeze(1) == allowed).any(dim=1).all()
    assert picked[::3].unique().numel() > 1  # it did sample, not always the top token


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(_top_p_filter(logits, p))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(0.5) == [1]  # the top token alone reaches 0.5
    assert kept(0.79) == [1, 3]
    assert kept(0.81) == [1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    filtered = torch.softmax(_top_p_filter(logits, 0.79), dim=-1)
    torch.testing.assert_close(filtered[0, [1, 3]], torch.tensor([0.5, 0.3]) / 0.8)  # renormalised


def test_generation_stops_at_the_end_of_text_id(model: GPTModel, prompts: torch.Tensor) -> None:
    prompt = prompts[:1]
    greedy = generate(model, prompt, 20)[0, 5:].tolist()
    stop = greedy[3]
    first = greedy.index(stop)
    out = generate(model, prompt, 20, eos_id=stop)
    assert out[0, 5:].tolist() == greedy[:first]  # the end-of-text itself is not appended, as in the book
    assert torch.equal(generate(model, prompt, 20, eos_id=stop, use_cache=False), out)


@pytest.mark.parametrize("every_row_stops", [False, True])
def test_finished_rows_are_padded_until_every_row_stops(
    model: GPTModel, prompts: torch.Tensor, every_row_stops: bool
) -> None:
    greedy = generate(model, prompts, 20)[:, 5:]
    rows = greedy.tolist()
    # A token every row produces, at different steps; or one that only some rows produce.
    shared = [t for t in rows[0] if all(t in row for row in rows) and len({row.index(t) for row in rows}) > 1]
    stop = shared[0] if every_row_stops else rows[0][2]
    ends = [row.index(stop) if stop in row else None for row in rows]
    assert (None not in ends) == every_row_stops
    assert len(set(ends)) > 1  # rows stop at different steps, so some are padded
    out = generate(model, prompts, 20, eos_id=stop)[:, 5:]
    length = max(ends) if every_row_stops else 20
    assert out.shape == (3, length)
    for row, end in enumerate(ends):
        keep = length if end is None else end
        assert torch.equal(out[row, :keep], greedy[row, :keep])
        assert (out[row, keep:] == stop).all()


def test_generate_runs_in_eval_mode_and_restores_training_mode(
    model: GPTModel, prompts: torch.Tensor
) -> None:
    expected = generate(model, prompts, 10)
    model.train()
    try:
        assert torch.equal(generate(model, prompts, 10), expected)  # no dropout while generating
        assert model.training
    finally:
        model.eval()


def test_zero_new_tokens_returns_the_prompt(model: GPTModel, prompts: torch.Tensor) -> None:
    assert torch.equal(generate(model, prompts, 0), prompts)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_bad_arguments_are_refused(
    model: GPTModel, prompts: torch.Tensor, kwargs: dict, message: str
) -> None:
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, **kwargs)


def test_bad_inputs_are_refused(model: GPTModel, prompts: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="idx"):
        generate(model, prompts[0], 3)  # 1-D
    with pytest.raises(ValueError, match="idx"):
        generate(model, prompts.float(), 3)
    classifier = build_gpt(ModelConfig(**{**TINY_LM, "num_classes": 2}))
    with pytest.raises(ValueError, match="classification head"):
        generate(classifier, prompts, 3)


def test_generate_text_is_seeded_and_starts_with_the_prompt(tokenizer) -> None:
    torch.manual_seed(0)
    model = build_gpt(ModelConfig(**{**TINY_LM, "vocab_size": 50257}))
    sample = SampleConfig(
        prompt="Every effort moves you", max_new_tokens=8, temperature=1.0, top_k=50, seed=123
    )
    text = generate_text(model, tokenizer, sample)
    assert text.startswith(sample.prompt)
    assert len(tokenizer.encode(text)) > len(tokenizer.encode(sample.prompt))
    assert generate_text(model, tokenizer, sample) == text
    other = generate_text(model, tokenizer, SampleConfig(**{**sample.__dict__, "seed": 124}))
    assert other != text
    greedy = SampleConfig(**{**sample.__dict__, "temperature": 0.0})
    ids = torch.tensor([tokenizer.encode(sample.prompt)])
    greedy_ids = generate(model, ids, 8)[0].tolist()
    assert generate_text(model, tokenizer, greedy) == tokenizer.decode(greedy_ids)
    # An end-of-text id stops the text before it.
    stop = greedy_ids[ids.shape[1] + 2]
    cut = greedy_ids[: greedy_ids.index(stop, ids.shape[1])]
    assert generate_text(model, tokenizer, greedy, eos_id=stop) == tokenizer.decode(cut)
