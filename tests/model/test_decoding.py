"""FusedDecoder: the modules' decoding steps without the modules, bit for bit, and only where it applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptlab.model import generate as generation
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


def steps_both_ways(model: GPTModel, prompt: torch.Tensor, steps: int, pad: torch.Tensor | None = None):
    """The hidden states of `steps` decoding steps through the modules and through the decoder, same tokens fed."""
    caches = [KVCache(model.cfg.n_layers, model.cfg.context_length, pad) for _ in range(2)]
    decoder = FusedDecoder(model)
    ids = torch.randint(
        0, model.cfg.vocab_size, (prompt.shape[0], steps), generator=torch.Generator().manual_seed(3)
    )
    outputs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    with torch.inference_mode():
        for cache in caches:
            model.hidden_states(prompt, cache)  # the prefill, through the modules both ways
        for step in range(steps):
            token = ids[:, step : step + 1]
            outputs[0].append(model.hidden_states(token, caches[0]))
            outputs[1].append(decoder.hidden_states(token, caches[1]))
    return outputs


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_decoding_steps_equal_the_modules_bit_for_bit(qkv_bias: bool) -> None:
    model = fused_model(qkv_bias=qkv_bias)
    prompt = torch.randint(0, FUSED.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    modules, decoder = steps_both_ways(model, prompt, 30)
    for a, b in zip(modules, decoder, strict=True):
        assert torch.equal(a, b)


def test_left_padded_rows_decode_as_through_the_modules() -> None:
    model = fused_model()
    prompt = torch.randint(0, FUSED.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    modules, decoder = steps_both_ways(model, prompt, 12, pad=torch.tensor([3, 0]))
    for a, b in zip(modules, decoder, strict=True):
        assert torch.equal(a, b)


def test_generate_takes_its_steps_through_the_decoder_and_follows_new_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = fused_model()
    prompt = torch.tensor([[4, 8, 15]])
    steps = []
    real = FusedDecoder.hidden_states
    monkeypatch.setattr(FusedDecoder, "hidden_states", lambda self, *a: steps.append(1) or real(self, *a))
    fast = generate(model, prompt, 25)
    assert len(steps) == 24  # every token after the prefill's
    monkeypatch.setattr(generation.FusedDecoder, "fits", staticmethod(lambda *a: False))
    assert torch.equal(generate(model, prompt, 25), fast)

    with torch.no_grad():  # as an optimizer step would: the decoder must read the new weights
        for p in model.parameters():
            p.mul_(1.5)
    after = generate(model, prompt, 25)
    monkeypatch.undo()
    assert torch.equal(generate(model, prompt, 25), after)
    assert not torch.equal(after, fast)


def test_the_decoder_applies_only_where_the_modules_would_decode_the_same_way() -> None:
    def rows(n: int, device: str = "cpu") -> torch.Tensor:
        return torch.zeros(n, 4, dtype=torch.long, device=device)  # n prompts of 4 tokens

    with torch.inference_mode():
        assert FusedDecoder.fits(fused_model(), rows(1))
        assert FusedDecoder.fits(fused_model(), rows(2))
        assert not FusedDecoder.fits(fused_model(), rows(3))  # more rows: the (out, in) matmuls
        assert not FusedDecoder.fits(fused_model(kernels="book"), rows(1))
        assert not FusedDecoder.fits(fused_model(attention="masked_softmax"), rows(1))
        assert not FusedDecoder.fits(fused_model().train(), rows(1))
        assert not FusedDecoder.fits(fused_model(), rows(1, "meta"))
        lora = fused_model()
        add_lora(lora, rank=2, alpha=4)
        assert not FusedDecoder.fits(lora.eval(), rows(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not FusedDecoder.fits(fused_model(), rows(1))
    assert not FusedDecoder.fits(fused_model(), rows(1))  # gradients on: training code calls the modules
