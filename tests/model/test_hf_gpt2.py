"""Conversion between Hugging Face's GPT-2 and our GPTModel, checked against transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from gptlab.cli.main import main
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import (
    config_from_hf,
    export_checkpoint,
    gptlab_to_hf,
    load_hf_folder,
    load_hf_weights,
    save_hf,
)

TINY = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32, "vocab_size": 300}


def random_hf_model(seed: int = 0, **config: int) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with every parameter random, biases and layer norms included.

    transformers initialises biases to zero and norms to one, which would hide a
    bias or norm mapped to the wrong place; here nothing is left at its default.
    """
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**config))
    model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_scale = ".ln_" in name and name.endswith("weight")
            param.normal_(1.0 if is_norm_scale else 0.0, 0.02, generator=generator)
    return model.eval()


def tiny_gptlab_model(seed: int = 0, **overrides: object) -> GPTModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=300, context_length=32, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=True)
    model = build_gpt(ModelConfig(**{**cfg.to_dict(), **overrides}))
    with torch.no_grad():  # random norms too, so a swapped scale/shift cannot hide
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0 if name.endswith("scale") else 0.0, 0.1)
    return model.eval()


def tie(model: GPTModel) -> GPTModel:
    with torch.no_grad():
        model.out_head.weight.copy_(model.tok_emb.weight)
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_tiny_hf_model_loads_with_equal_logits(tmp_path: Path) -> None:
    hf = random_hf_model(**TINY)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf_folder(tmp_path)
    assert ours.cfg.n_heads == 2 and ours.cfg.qkv_bias and ours.cfg.context_length == 32
    ids = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(1))
    expected = logits(hf, ids)
    torch.testing.assert_close(logits(ours, ids), expected, rtol=0, atol=1e-5)
    # The bare weights file (save_pretrained's `transformer.` layout) with the head count given.
    bare = load_hf_weights(tmp_path / "model.safetensors", n_heads=2)
    torch.testing.assert_close(logits(bare, ids), expected, rtol=0, atol=1e-5)
    # A separate head tensor (the book's copy), not the embedding itself.
    assert ours.out_head.weight.data_ptr() != ours.tok_emb.weight.data_ptr()
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in ours.parameters())


def test_untied_hf_model_keeps_its_own_head(tmp_path: Path) -> None:
    hf = random_hf_model(**TINY)
    hf.config.tie_word_embeddings = False
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(300, 32))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    ours = load_hf_folder(tmp_path)
    ids = torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(logits(ours, ids), logits(hf, ids), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_gpt2_small_shapes_in_openai_hub_layout(tmp_path: Path) -> None:
    """Exactly gpt2-small's shapes, keyed as OpenAI's hub file is: no prefix, mask buffers, no head."""
    hf = random_hf_model()  # GPT2Config() defaults are gpt2-small
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    mask = torch.tril(torch.ones(1024, 1024)).view(1, 1, 1024, 1024)
    for i in range(12):
        state[f"h.{i}.attn.bias"] = mask.clone()
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(tmp_path / "model.safetensors"))

    ours = load_hf_weights(tmp_path / "model.safetensors")  # heads inferred: 768 / 64
    assert ours.cfg == ModelConfig.from_preset(
        "gpt2-small", context_length=1024, qkv_bias=True, drop_rate=0.1
    )
    ids = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(ours, ids), logits(hf, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_ours_to_hf_to_ours_is_bitwise_equal(tmp_path: Path, tied: bool) -> None:
    model = tiny_gptlab_model()  # a fresh model's head differs from its embedding
    if tied:
        tie(model)
    save_hf(model, tmp_path)
    assert ("lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))) is not tied
    back = load_hf_folder(tmp_path)
    assert back.cfg == model.cfg
    original = model.state_dict()
    restored = back.state_dict()
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_export_loads_in_transformers_with_equal_logits(tmp_path: Path, qkv_bias: bool) -> None:
    model = tie(tiny_gptlab_model(qkv_bias=qkv_bias))
    save_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), rtol=0, atol=1e-5)
    if not qkv_bias:  # no bias is exported as a zero bias
        assert not hf.transformer.h[0].attn.c_attn.bias.any()


def test_untied_export_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    model = tiny_gptlab_model()  # a fresh model's head differs from its embedding
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    assert load_file(str(tmp_path / "model.safetensors"))["lm_head.weight"].shape == (300, 32)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert not hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    assert torch.equal(hf.lm_head.weight, model.out_head.weight)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), rtol=0, atol=1e-5)


def test_tie_head_ties_and_drops_the_head(tmp_path: Path) -> None:
    model = tiny_gptlab_model()
    save_hf(model, tmp_path, tie_head=True)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (1, 20))
    # What was dropped: out_head. The exported model uses the embedding as its head.
    torch.testing.assert_close(logits(hf, ids), logits(tie(model), ids), rtol=0, atol=1e-5)
    assert torch.equal(load_hf_folder(tmp_path).out_head.weight, model.tok_emb.weight)


def test_classifier_checkpoint_is_refused(tmp_path: Path) -> None:
    save_model(tiny_gptlab_model(num_classes=2), tmp_path / "spam")
    with pytest.raises(ValueError, match="classifier"):
        export_checkpoint(tmp_path / "spam", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_gptlab_model()  # untied: its own head is exported
    save_model(model, tmp_path / "ckpt")
    ids = torch.randint(0, 300, (1, 8))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), rtol=0, atol=1e-5)

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "tied"), "--tie-head"]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "tied").eval()
    torch.testing.assert_close(logits(hf, ids), logits(tie(model), ids), rtol=0, atol=1e-5)


def test_wrong_shape_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    state = gptlab_to_hf(tie(tiny_gptlab_model()))
    state["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(
        128, 32
    )  # transposed: Linear's layout, not Conv1D's
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"h\.1\.mlp\.c_fc\.weight has shape \[128, 32\], expected \[32, 128\]"
    ):
        load_hf_weights(tmp_path / "model.safetensors", n_heads=2)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    state = gptlab_to_hf(tie(tiny_gptlab_model()))
    missing = {k: v for k, v in state.items() if k != "transformer.h.0.ln_2.bias"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor h\.0\.ln_2\.bias"):
        load_hf_weights(tmp_path / "missing.safetensors", n_heads=2)
    extra = {**state, "transformer.h.0.attn.rotary.weight": torch.zeros(4)}
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor h\.0\.attn\.rotary\.weight"):
        load_hf_weights(tmp_path / "extra.safetensors", n_heads=2)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    save_hf(tie(tiny_gptlab_model()), tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        load_hf_folder(tmp_path)


def test_unsupported_hf_settings_are_named() -> None:
    base = {
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "n_positions": 32,
        "vocab_size": 300,
    }
    cfg, tied = config_from_hf(base)
    assert (cfg.emb_dim, cfg.n_heads, cfg.n_layers, cfg.context_length, tied) == (32, 2, 2, 32, True)
    with pytest.raises(ValueError, match="activation_function='relu'"):
        config_from_hf({**base, "activation_function": "relu"})
    with pytest.raises(ValueError, match="n_inner=64"):
        config_from_hf({**base, "n_inner": 64})
    with pytest.raises(ValueError, match="model_type 'llama'"):
        config_from_hf({**base, "model_type": "llama"})
