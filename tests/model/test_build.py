"""build_gpt: the book's model with its weights, computing with the kernels and attention the config names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptlab.model import gpt
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.dropout import Dropout
from gptlab.model.fast_kernels import (
    DecodeLinear,
    FusedGELU,
    FusedLayerNorm,
    FusedQKVAttention,
    FusedQKVSdpaAttention,
    SdpaAttention,
)
from gptlab.model.gpt import GPTModel

SMALL = ModelConfig(vocab_size=97, context_length=24, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
# What each setting swaps in: the attention class, and whether the fused kernels' modules are there.
VARIANTS = {
    ("book", "sdpa"): (SdpaAttention, False),
    ("fused", "masked_softmax"): (FusedQKVAttention, True),
    ("fused", "sdpa"): (FusedQKVSdpaAttention, True),
}


@pytest.mark.parametrize(("kernels", "attention"), list(VARIANTS))
def test_each_variant_is_the_books_model_with_its_weights_and_its_outputs(
    kernels: str, attention: str
) -> None:
    torch.manual_seed(123)
    book = GPTModel(SMALL).eval()
    torch.manual_seed(123)
    fast = build_gpt(dataclasses.replace(SMALL, kernels=kernels, attention=attention)).eval()
    assert isinstance(fast, GPTModel)
    attention_class, fused = VARIANTS[kernels, attention]
    kinds = {type(m) for m in fast.modules()}
    assert attention_class in kinds
    if fused:
        assert {DecodeLinear, FusedLayerNorm, FusedGELU, Dropout} <= kinds
    else:
        assert kinds.isdisjoint({DecodeLinear, FusedLayerNorm, FusedGELU, Dropout})
    book_state, fast_state = book.state_dict(), fast.state_dict()
    assert list(fast_state) == list(book_state)  # same names in the same order: checkpoints load unchanged
    for name, tensor in book_state.items():
        assert torch.equal(fast_state[name], tensor), name  # same random draws, in the same order
    ids = torch.randint(
        0, SMALL.vocab_size, (2, SMALL.context_length), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(fast(ids), book(ids))


def test_the_books_settings_build_the_books_modules_only() -> None:
    model = build_gpt(dataclasses.replace(SMALL, kernels="book", attention="masked_softmax"))
    where = {type(m).__module__ for m in model.modules()}
    assert all(name == gpt.__name__ or name.startswith("torch.nn.modules.") for name in where), where
