"""Appendix E, LoRA: the trainable parameters it counts."""

from __future__ import annotations

from gptlab.book.figures.inputs import FigureInputs
from gptlab.model.config import ModelConfig

__all__ = ["trainable_count"]


def trainable_count(
    run: FigureInputs | None,
    preset: str,
    context_length: int,
    qkv_bias: bool,
    num_classes: int | None = None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
) -> int:
    """Trainable parameters as appendix E counts them: the model (with a fresh `num_classes` head) as
    built, every parameter trainable; or, with `lora_rank`, frozen with LoRA on every linear layer."""
    # torch on first use: keeps `gptlab --help` fast
    import torch
    from torch import nn

    from gptlab.model.build import build_gpt
    from gptlab.model.lora import add_lora

    with torch.device("meta"):
        model = build_gpt(ModelConfig.from_preset(preset, context_length=context_length, qkv_bias=qkv_bias))
        if num_classes is not None:
            model.out_head = nn.Linear(model.cfg.emb_dim, num_classes)
        if lora_rank is not None:
            add_lora(model, lora_rank, lora_alpha if lora_alpha is not None else lora_rank)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
