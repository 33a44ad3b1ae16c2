"""FusedDecoder: the modules' decoding steps without the modules, bit for bit, and only where it applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.decoding import FusedDecoder
from gptlab.model.generate import generate
from gptlab.model.gpt import GPTModel
from gptlab.model.kv_cache import KVCache
from gptlab.model.lora import add_lora

FUSED = ModelConfig(
    vocab_size=211, context_length=48, emb_dim=64, n_heads=4, n_layers=3, drop_rate=0.1, kernels="fused"
)


def fused_model(**overrides: object) -> GPTModel:
    torch.manual_seed(5)
    return build_gpt(dataclasses.replace(FUSED, **overrides)).eval()


def greedy_logits(
    model: GPTModel, prompt: torch.Tensor, steps: int, pad: torch.Tensor | None, decoder: FusedDecoder | None
) -> list[torch.Tensor]:
    """The logits (b, vocab) of a greedy generation's prompt and its decoding steps, each token the argmax."""
    cache = KVCache(model.cfg.n_layers, model.cfg.context_length, pad)
    logits = [model.out_head(model.hidden_states(prompt, cache)[:, -1])]  # the prefill, through the modules
    for _ in range(steps):
        token = logits[-1].argmax(dim=-1, keepdim=True)  # (b, 1)
        if decoder is None:
            hidden = model.hidden_states(token, cache)
        else:
            assert decoder.takes(token)  # past the modules, not falling back to them
            hidden = decoder.hidden_states(token, cache)
        logits.append(model.out_head(hidden[:, -1]))
    return logits


CASES = {
    "one row": ({}, torch.tensor([[4, 8, 15, 16, 23, 42]]), None),
    "one row, qkv bias": ({"qkv_bias": True}, torch.tensor([[4, 8, 15, 16, 23, 42]]), None),
    "one row, masked softmax": (
        {"attention": "masked_softmax"},
        torch.tensor([[4, 8, 15, 16, 23, 42]]),
        None,
    ),
    "left-padded rows": (
        {"qkv_bias": True},
        torch.tensor([[0, 0, 0, 7, 9, 11, 13], [1, 2, 3, 5, 8, 13, 21]]),
        3,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_decoders_greedy_logits_are_the_modules_bit_for_bit(case: str) -> None:
    """The one check on the decoder's second copy of a block's forward: every step's logits, equal bits."""
    overrides, prompt, padding = CASES[case]
    model = fused_model(**overrides)
    pad = None if padding is None else torch.tensor([padding, 0])
    with torch.inference_mode():
        modules = greedy_logits(model, prompt, 30, pad, None)
        decoded = greedy_logits(model, prompt, 30, pad, FusedDecoder(model))
    assert len(set(torch.cat(modules).argmax(dim=-1).tolist())) > 3  # a real continuation
    for a, b in zip(modules, decoded, strict=True):
        assert torch.equal(a, b)


def test_generate_takes_its_steps_through_the_decoder_and_follows_new_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = fused_model()
    prompt = torch.tensor([[4, 8, 15]])
    steps = []
    real = FusedDecoder.takes
    monkeypatch.setattr(FusedDecoder, "takes", lambda self, ids: real(self, ids) and not steps.append(1))
    fast = generate(model, prompt, 25)
    assert len(steps) == 24  # every token after the prefill's
    monkeypatch.setattr(FusedDecoder, "takes", lambda self, ids: False)  # every step through the modules
    assert torch.equal(generate(model, prompt, 25), fast)

    with torch.no_grad():  # as an optimizer step would: the decoder must read the new weights
        for p in model.parameters():
            p.mul_(1.5)
    slow = generate(model, prompt, 25)
    monkeypatch.undo()
    assert torch.equal(generate(model, prompt, 25), slow)
    assert not torch.equal(slow, fast)


def test_the_decoder_applies_only_where_the_modules_would_decode_the_same_way() -> None:
    def takes(model: GPTModel, rows: int, device: str = "cpu") -> bool:
        with torch.inference_mode():
            return FusedDecoder(model).takes(torch.zeros(rows, 1, dtype=torch.long, device=device))

    assert takes(fused_model(), 1)
    assert takes(fused_model(), 2)
    assert takes(fused_model(attention="masked_softmax"), 1)  # its own attention kernel, reused
    assert not takes(fused_model(), 3)  # more rows: the (out, in) matmuls
    assert not takes(fused_model(kernels="book"), 1)
    assert not takes(fused_model().train(), 1)
    assert not takes(fused_model(), 1, "meta")
    lora = fused_model()
    add_lora(lora, rank=2, alpha=4)
    assert not takes(lora.eval(), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes(fused_model(), 1)
    assert not FusedDecoder(fused_model()).takes(torch.zeros(1, 1, dtype=torch.long))  # gradients on
