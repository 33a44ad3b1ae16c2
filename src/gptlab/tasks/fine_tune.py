"""What both fine-tunes do alike to their base model: load it, check it is a language model, choose what trains.

`spam.trainable` and `instruct.trainable` name a mode (`Trainable`); what each mode
trains is said here, in `select_trainable`, and nowhere else: the stages, the
classifier's head surgery and the stage's report of what trains all ask this module.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import torch

from gptlab.errors import InputError
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, read_config
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.tasks.config import Trainable, check_trainable_blocks


def require_language_model(cfg: ModelConfig, base_dir: Path, key: str) -> None:
    """Refuse a base model that is already a classifier: a fine-tune starts from a language model."""
    if not cfg.is_language_model:
        raise InputError(f"{base_dir} is already a classifier: {key} must name a GPT-2 language model")


def base_language_model(
    base_dir: Path,
    weights: Literal["pretrained", "random"],
    drop_rate: float,
    seed: int,
    device: torch.device,
    key: str,
) -> tuple[GPTModel, dict[str, Any]]:
    """The language model to fine-tune and its metadata: the checkpoint, or its architecture freshly drawn.

    `random` seeds, then builds the model on the CPU (the book's draws on any device) and
    moves it, as the bonus script's `--weights random` does.
    """
    if weights == "random":
        base_cfg, base_metadata = read_config(base_dir)
        require_language_model(base_cfg, base_dir, key)
        torch.manual_seed(seed)
        model = build_gpt(dataclasses.replace(base_cfg, drop_rate=drop_rate))
        return model.to(device).eval(), base_metadata
    model, base_metadata = load_model(base_dir, device, drop_rate=drop_rate)
    require_language_model(model.cfg, base_dir, key)
    return model, base_metadata


def select_trainable(model: GPTModel, trainable: Trainable, blocks: int | None = None) -> None:
    """Let exactly what `trainable` names train (requires_grad, in place); `blocks`: last_blocks' count.

    - head: the output head only;
    - last_blocks: the last `blocks` transformer blocks, the final norm and the head (chapter 6);
    - all: every weight (chapter 7);
    - lora: no weight of the model, its head neither: the LoRA adapters the stage then wraps every
      linear layer with (`gptlab.model.lora.add_lora`, see `adds_lora`) are what trains (appendix E).
    """
    layers = len(model.trf_blocks)
    if blocks is not None:
        check_trainable_blocks(blocks, layers, "the base model")
    model.requires_grad_(trainable == "all")
    if trainable in ("head", "last_blocks"):
        model.out_head.requires_grad_(True)
    if trainable == "last_blocks":
        assert blocks is not None, "last_blocks trains a number of blocks"
        for block in model.trf_blocks[layers - blocks :]:
            block.requires_grad_(True)
        model.final_norm.requires_grad_(True)


def adds_lora(trainable: Trainable) -> bool:
    """Whether the stage adds LoRA adapters (the only weights that train) and merges them once trained."""
    return trainable == "lora"
