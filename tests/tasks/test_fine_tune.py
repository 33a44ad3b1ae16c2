"""What the fine-tunes train of their base model, and the base model they accept, on a tiny GPT."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gptlab.errors import InputError
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.lora import add_lora
from gptlab.schema import ConfigError
from gptlab.tasks.fine_tune import adds_lora, base_language_model, require_language_model, select_trainable

TINY = ModelConfig(context_length=16, emb_dim=16, n_heads=2, n_layers=3, drop_rate=0.0)


def training(model: GPTModel) -> set[str]:
    """The top-level parts (a block by its index) holding a parameter that trains."""
    return {
        ".".join(name.split(".")[:2]) if name.startswith("trf_blocks") else name.split(".")[0]
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@pytest.mark.parametrize(
    ("trainable", "blocks", "parts"),
    [
        ("head", 1, {"out_head"}),
        ("last_blocks", 2, {"trf_blocks.1", "trf_blocks.2", "final_norm", "out_head"}),
        (
            "all",
            None,
            {"tok_emb", "pos_emb", "trf_blocks.0", "trf_blocks.1", "trf_blocks.2", "final_norm", "out_head"},
        ),
        ("lora", None, set()),
    ],
)
def test_each_mode_trains_exactly_its_parts(trainable: str, blocks: int | None, parts: set[str]) -> None:
    model = GPTModel(TINY)
    model.requires_grad_(trainable != "all")  # whatever trained before, the mode alone decides
    select_trainable(model, trainable, blocks)  # type: ignore[arg-type]
    assert training(model) == parts


def test_lora_leaves_only_the_adapters_training() -> None:
    model = GPTModel(TINY)
    select_trainable(model, "lora")
    assert adds_lora("lora") and not any(adds_lora(mode) for mode in ("head", "last_blocks", "all"))
    add_lora(model, rank=2, alpha=2)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora." in name for name in trained)


@pytest.mark.parametrize("blocks", [0, 4])
def test_trainable_blocks_outside_the_models_blocks_is_refused_naming_the_key(blocks: int) -> None:
    with pytest.raises(ConfigError, match=r"^spam\.trainable_blocks: expected"):
        select_trainable(GPTModel(TINY), "last_blocks", blocks)


def test_a_classifier_is_no_base_model() -> None:
    require_language_model(TINY, Path("models/gpt2/tiny"), "spam.base_model")
    classifier = ModelConfig(**{**TINY.to_dict(), "num_classes": 2})
    assert TINY.is_language_model and not classifier.is_language_model
    with pytest.raises(InputError, match=r"models/gpt2/tiny is already a classifier: instruct\.base_model"):
        require_language_model(classifier, Path("models/gpt2/tiny"), "instruct.base_model")


def test_random_base_weights_are_the_architecture_freshly_seeded(tmp_path: Path) -> None:
    torch.manual_seed(1)
    cfg = ModelConfig(context_length=16, emb_dim=16, n_heads=2, n_layers=1, qkv_bias=True)
    save_model(build_gpt(cfg), tmp_path / "base", {"stage": "load-gpt2"})
    model, metadata = base_language_model(
        tmp_path / "base", "random", 0.0, 123, torch.device("cpu"), "spam.base_model"
    )
    torch.manual_seed(123)
    expected = build_gpt(dataclasses.replace(cfg, drop_rate=0.0))
    assert metadata == {"stage": "load-gpt2"} and model.cfg.drop_rate == 0.0
    for (name, ours), theirs in zip(model.state_dict().items(), expected.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    loaded, _ = base_language_model(
        tmp_path / "base", "pretrained", 0.0, 123, torch.device("cpu"), "spam.base_model"
    )
    assert not torch.equal(loaded.tok_emb.weight, model.tok_emb.weight)
