"""The KV cache: each step's logits are the full forward's, its buffers are written in place, padding is ignored."""

from __future__ import annotations

import pytest
import torch

from gptlab.model.gpt import GPTModel
from gptlab.model.kv_cache import KVCache

from helpers import TINY_LM

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/model/conftest.py


def test_cached_logits_match_full_forward_at_every_step(model: GPTModel, prompts: torch.Tensor) -> None:
    ids = torch.cat([prompts, torch.randint(0, TINY_LM["vocab_size"], (3, 20))], dim=1)  # (3, 25)
    cache = KVCache(TINY_LM["n_layers"], TINY_LM["context_length"])
    with torch.no_grad():
        step_logits = [model(ids[:, :5], cache)[:, -1]]
        for t in range(5, ids.shape[1]):
            step_logits.append(model(ids[:, t : t + 1], cache)[:, -1])
        full = model(ids)
    assert cache.length == ids.shape[1]
    for i, logits in enumerate(step_logits):
        torch.testing.assert_close(logits, full[:, 4 + i], rtol=0, atol=1e-5)


def test_the_cache_writes_in_place_into_buffers_allocated_once(
    model: GPTModel, prompts: torch.Tensor
) -> None:
    cache = KVCache(TINY_LM["n_layers"], TINY_LM["context_length"])
    with torch.no_grad():
        model(prompts, cache)
        buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        for step in range(3):
            model(prompts[:, step : step + 1], cache)
    assert cache.length == 5 + 3
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == buffers
    assert cache.layers[0].keys.shape == (3, TINY_LM["n_heads"], TINY_LM["context_length"], 16)


def test_left_padded_rows_give_the_logits_of_their_unpadded_prompts(model: GPTModel) -> None:
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, TINY_LM["vocab_size"], (n,), generator=gen) for n in (7, 3, 5)]
    pad = torch.tensor([7 - len(row) for row in rows])
    padded = torch.stack([torch.cat([torch.full((7 - len(row),), 96), row]) for row in rows])  # (3, 7)
    cache = KVCache(TINY_LM["n_layers"], TINY_LM["context_length"], pad)
    with torch.no_grad():
        prefill = model(padded, cache)  # (3, 7, vocab)
        step = model(torch.tensor([[11], [12], [13]]), cache)[:, -1]  # one more token per row
        for i, row in enumerate(rows):
            alone = model(torch.cat([row, torch.tensor([11 + i])]).unsqueeze(0))[0]  # (n + 1, vocab)
            torch.testing.assert_close(prefill[i, pad[i] :], alone[:-1], rtol=0, atol=1e-5)
            torch.testing.assert_close(step[i], alone[-1], rtol=0, atol=1e-5)
