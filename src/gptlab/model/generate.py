"""Text generation: greedy decoding, temperature, top-k and top-p sampling, with a KV cache.

This is the book's chapter 5 `generate` (top-k, then temperature, then
`torch.multinomial` on the global RNG, so seeded samples match the book's;
`generate_text` seeds it inside a fork, leaving the caller's RNG untouched),
extended with nucleus (top-p) filtering and a KV cache (kv_cache.py). The
cache changes only the speed: greedy output is the same token for token as
without it.
No progress bars: callers generate short continuations inside their own loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import tiktoken
import torch

from gptlab.errors import InputError
from gptlab.model.config import SampleConfig
from gptlab.model.decoding import FusedDecoder
from gptlab.model.gpt import GPTModel
from gptlab.model.kv_cache import KVCache
from gptlab.model.tokenizer import text_to_token_ids, token_ids_to_text


@torch.inference_mode()
def generate(
    model: GPTModel,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    pad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Continue the (b, t) token ids `idx` by up to `max_new_tokens`; returns (b, t + n) ids.

    temperature 0 is greedy (top_k / top_p then change nothing). Generation
    stops once every row has produced `eos_id`; as in the book, that final
    end-of-text is not appended, and rows that finished earlier are padded with
    `eos_id`. Inputs longer than the context length are cropped to their last
    `context_length` tokens for each prediction. The model runs in eval mode
    (no dropout) and is put back in its previous mode afterwards.

    With the cache, each new token costs one forward of that token over the
    cached keys, until the context is full. From then on every position shifts
    with each new token (GPT-2's positions are absolute), so the cache is
    rebuilt from the cropped window: one forward of `context_length` tokens per
    token, exactly what the uncached loop computes, so the output is the same.

    `pad` (b,) generates a batch of prompts of different lengths at once: row i
    starts with `pad[i]` padding tokens (any ids) before its prompt, which the
    model ignores; prompt and answer must then fit the context (no sliding).
    """
    _check_arguments(model, idx, max_new_tokens, temperature, top_k, top_p)
    context_length = model.cfg.context_length
    if pad is not None and (not use_cache or idx.shape[1] + max_new_tokens > context_length):
        raise InputError(
            f"padded rows need the cache and must fit the context: {idx.shape[1]} + {max_new_tokens} "
            f"tokens > {context_length}"
        )
    idx = idx.to(next(model.parameters()).device)
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    cache = KVCache(model.cfg.n_layers, context_length, pad)
    was_training = model.training
    model.eval()
    decoder = FusedDecoder(model)  # past the modules where they would decode, else through them
    try:
        for _ in range(max_new_tokens):
            if not use_cache:
                hidden = model.hidden_states(idx[:, -context_length:])
            elif cache.length == 0 or cache.length + 1 > context_length:
                # Prefill; or, once the window slides, every position shifts and the
                # cached keys and values are stale: rebuild them from the cropped
                # window, exactly what the uncached path computes.
                cache.reset()
                hidden = model.hidden_states(idx[:, -context_length:], cache)
            else:  # only the newest token; the rest is cached
                hidden = decoder.hidden_states(idx[:, -1:], cache)
            logits = model.out_head(hidden[:, -1])  # (b, vocab): the prompt's other positions need none
            idx_next = _pick(logits, temperature, top_k, top_p)  # (b, 1)
            if eos_id is not None:
                idx_next = idx_next.masked_fill(finished.unsqueeze(1), eos_id)
                finished |= idx_next.squeeze(1) == eos_id
                if finished.all():
                    break
            idx = torch.cat((idx, idx_next), dim=1)  # (b, t + 1)
    finally:
        model.train(was_training)
    return idx


def generate_each(
    model: GPTModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos_id: int
) -> list[list[int]]:
    """Greedy continuations of several prompts at once, each as `generate` alone would give it.

    The prompts are padded on the left into one batch; a row that reaches
    `eos_id` stops there (the batch runs on until every row has), and each
    continuation comes back without its prompt, its end-of-text or padding.
    """
    longest = max(len(prompt) for prompt in prompts)
    pad = torch.tensor([longest - len(prompt) for prompt in prompts])
    idx = torch.tensor(
        [[eos_id] * (longest - len(prompt)) + list(prompt) for prompt in prompts]
    )  # (b, longest)
    out = generate(model, idx, max_new_tokens, eos_id=eos_id, pad=pad)[:, longest:].tolist()  # (b, n)
    return [row[: row.index(eos_id)] if eos_id in row else row for row in out]


def generate_text(
    model: GPTModel, tokenizer: tiktoken.Encoding, sample: SampleConfig, *, eos_id: int | None = None
) -> str:
    """The prompt plus its continuation, seeded with `sample.seed` so reruns give the same text.

    The seed is set inside a fork of the RNG, so the caller's random state (a
    training run's dropout masks and data order) is the same afterwards.
    """
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(sample.seed)
        ids = text_to_token_ids(sample.prompt, tokenizer)  # (1, t)
        out = generate(
            model,
            ids,
            sample.max_new_tokens,
            temperature=sample.temperature,
            top_k=sample.top_k,
            eos_id=eos_id,
        )
    return token_ids_to_text(out, tokenizer)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Next token ids (b, 1) from logits (b, vocab)."""
    if temperature == 0.0:
        # Filtering keeps the largest logit, so greedy ignores top_k and top_p.
        return torch.argmax(logits, dim=-1, keepdim=True)
    return torch.multinomial(next_token_probabilities(logits, temperature, top_k, top_p), num_samples=1)


def next_token_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """What `generate` samples from (temperature > 0): softmax((logits, top-k / top-p filtered) / temperature).

    logits (b, vocab) or (vocab,); tokens outside the top k get probability 0 (section 5.3.2).
    Computed in fp32 whatever the logits' dtype (bf16 weights give bf16 logits).
    """
    logits = logits.float()
    if top_k is not None:
        top_logits, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
        min_val = top_logits[..., -1:]  # the k-th largest of each row
        logits = torch.where(logits < min_val, torch.tensor(float("-inf"), device=logits.device), logits)
    logits = logits / temperature
    if top_p is not None:
        logits = _top_p_filter(logits, top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (nucleus)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)  # (b, vocab)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the ones ranked above it already reach top_p; the top one always stays.
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def _check_arguments(
    model: GPTModel,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    if not model.cfg.is_language_model:
        raise InputError("generate needs a language-model head; this model has a classification head")
    if idx.ndim != 2 or idx.shape[1] == 0 or idx.dtype != torch.long:
        raise InputError(
            f"idx: expected a non-empty (batch, tokens) LongTensor, got {idx.dtype} {tuple(idx.shape)}"
        )
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens: expected 0 or more, got {max_new_tokens}")
    if temperature < 0.0:
        raise InputError(f"temperature: expected 0 (greedy) or a positive float, got {temperature}")
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k: expected a positive integer or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p: expected a value in (0, 1] or None, got {top_p}")
