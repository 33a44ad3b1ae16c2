"""The GPT-2 model against the book's figures: parameter counts, seeded output, and its invariants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.generate import generate
from gptlab.model.gpt import GELU, GPTModel, LayerNorm

TINY = ModelConfig(vocab_size=101, context_length=32, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.1)


def n_params(module: torch.nn.Module) -> int:
    """Unique parameters (a tied weight counts once), as `sum(p.numel() for p in parameters())`."""
    return sum(p.numel() for p in module.parameters())


def meta_model(preset: str, **overrides: object) -> GPTModel:
    """A model whose tensors have shapes but no storage, so even gpt2-xl costs no memory."""
    with torch.device("meta"):
        return build_gpt(ModelConfig.from_preset(preset, context_length=1024, qkv_bias=False, **overrides))


@pytest.fixture(scope="module")
def gpt2_small() -> GPTModel:
    # The book's chapter 4 set-up: seed 123, then build GPT_CONFIG_124M.
    torch.manual_seed(123)
    return build_gpt(ModelConfig(context_length=1024, qkv_bias=False)).eval()


def test_gpt2_small_parameter_counts() -> None:
    model = meta_model("gpt2-small")
    total = n_params(model)
    assert total == 163_009_536
    assert total - model.out_head.weight.numel() == 124_412_160
    assert round(total * 4 / 1024**2, 2) == 621.83  # MiB at fp32

    block = model.trf_blocks[0]
    assert n_params(block.ff) == 4_722_432
    assert n_params(block.att) == 2_360_064


def test_larger_presets_parameter_counts() -> None:
    assert n_params(meta_model("gpt2-medium")) == 406_212_608
    xl = meta_model("gpt2-xl")
    assert n_params(xl) == 1_637_792_000
    assert n_params(xl) - xl.out_head.weight.numel() == 1_557_380_800


def test_tied_head_with_qkv_bias_matches_openai_count() -> None:
    with torch.device("meta"):
        model = build_gpt(ModelConfig(context_length=1024, qkv_bias=True))
    model.out_head.weight = model.tok_emb.weight
    assert n_params(model) == 124_439_808


@pytest.mark.slow  # GPT-2 small at full size
@pytest.mark.parametrize("attention", ["sdpa", "masked_softmax"])
def test_seeded_gpt2_small_continues_like_the_book(gpt2_small: GPTModel, attention: str) -> None:
    # Chapter 4 prints "Hello, I am Featureiman Byeswickattribute argue" for this model.
    with torch.device("meta"):
        model = build_gpt(ModelConfig(context_length=1024, qkv_bias=False, attention=attention))
    model.load_state_dict(gpt2_small.state_dict(), assign=True)  # shares the seeded weights
    model.eval()
    hello = torch.tensor([[15496, 11, 314, 716]])
    out = generate(model, hello, max_new_tokens=6, use_cache=False)
    assert out[0, 4:].tolist() == [27018, 24086, 47843, 30961, 42348, 7267]


def test_seeded_weights_do_not_depend_on_attention_choice() -> None:
    # The attention kernel must not change parameter creation order, or seeding would drift.
    states = []
    for attention in ("sdpa", "masked_softmax"):
        torch.manual_seed(123)
        states.append(build_gpt(ModelConfig(**{**TINY.to_dict(), "attention": attention})).state_dict())
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name


@pytest.mark.parametrize("attention", ["sdpa", "masked_softmax"])
def test_later_tokens_never_change_earlier_logits(attention: str) -> None:
    torch.manual_seed(0)
    model = build_gpt(ModelConfig(**{**TINY.to_dict(), "attention": attention})).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 12:], after[:, 12:])  # the change itself is visible


def test_sdpa_and_masked_softmax_agree() -> None:
    torch.manual_seed(0)
    sdpa = build_gpt(TINY).eval()
    masked = build_gpt(ModelConfig(**{**TINY.to_dict(), "attention": "masked_softmax"})).eval()
    masked.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, TINY.vocab_size, (3, TINY.context_length))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids), masked(ids), rtol=0, atol=1e-5)


def test_layer_norm_normalises_with_population_variance() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, 16) * 3 + 2
    norm = LayerNorm(16)
    y = norm(x)
    torch.testing.assert_close(y.mean(dim=-1), torch.zeros(4, 5), rtol=0, atol=1e-5)
    torch.testing.assert_close(y.var(dim=-1, unbiased=False), torch.ones(4, 5), rtol=0, atol=1e-4)
    torch.testing.assert_close(y, F.layer_norm(x, (16,), eps=1e-5))
    # The learnable scale and shift apply after normalising.
    with torch.no_grad():
        norm.scale.fill_(2.0)
        norm.shift.fill_(-1.0)
    torch.testing.assert_close(norm(x), 2.0 * y - 1.0)


def test_gelu_is_the_tanh_approximation() -> None:
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(GELU()(x), F.gelu(x, approximate="tanh"))
    assert not torch.allclose(GELU()(x), F.gelu(x), rtol=0, atol=1e-5)  # not the exact erf form


def test_language_model_output_shape() -> None:
    model = build_gpt(TINY).eval()
    ids = torch.randint(0, TINY.vocab_size, (3, 7))
    assert model(ids).shape == (3, 7, TINY.vocab_size)


def test_classifier_head_outputs_num_classes() -> None:
    model = build_gpt(ModelConfig(**{**TINY.to_dict(), "num_classes": 2})).eval()
    ids = torch.randint(0, TINY.vocab_size, (3, 7))
    assert model(ids).shape == (3, 7, 2)
    assert model.out_head.bias is not None  # the book's classification head has a bias


def test_inputs_longer_than_the_context_are_refused() -> None:
    model = build_gpt(TINY).eval()
    with pytest.raises(AssertionError, match="context length"):
        model(torch.zeros(1, TINY.context_length + 1, dtype=torch.long))
