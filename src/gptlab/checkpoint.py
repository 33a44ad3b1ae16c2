"""Model checkpoints: weights as safetensors plus a JSON of the config and metadata.

The model's config travels with its weights, so downstream stages rebuild the
model from the checkpoint alone, never by re-reading another stage's params.
Files are written to a temporary name and renamed, so a crash never leaves a
half-written checkpoint behind. Resumable training state lives in train_state.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.architecture import ModelConfig
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model import GPTModel
from gptlab.typed_config import ConfigError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def save_model(model: GPTModel, directory: Path | str, metadata: dict[str, Any] | None = None) -> Path:
    """Write `model.safetensors` and `config.json` into `directory`; returns the directory."""
    return save_weights(cpu_weights(model), model.cfg, directory, metadata)


def cpu_weights(model: GPTModel) -> dict[str, torch.Tensor]:
    """A copy of the model's weights on the CPU, as safetensors wants them: contiguous and unshared."""
    # clone breaks tied weights.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def save_weights(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    directory: Path | str,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write weights taken by `cpu_weights` and their config as a checkpoint; returns the directory."""
    directory = Path(directory)
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    payload = {"model": cfg.to_dict(), "metadata": metadata or {}}
    with atomic_path(directory / CONFIG_FILE) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return directory


def read_config(directory: Path | str) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config and metadata stored beside a checkpoint's weights."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {directory} a gptlab checkpoint? Run its stage first.")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        return ModelConfig.from_dict(payload["model"]), dict(payload.get("metadata", {}))
    except (json.JSONDecodeError, KeyError, ConfigError) as exc:
        raise InputError(f"{path}: not a valid gptlab checkpoint config ({exc})") from exc


def load_model(
    directory: Path | str, device: torch.device | str = "cpu", **overrides: Any
) -> tuple[GPTModel, dict[str, Any]]:
    """Rebuild a GPTModel from a checkpoint directory; returns it (eval mode) and its metadata.

    `overrides` change config fields that do not alter the weights' shapes,
    such as `drop_rate` for fine-tuning or `attention`.
    """
    directory = Path(directory)
    cfg, metadata = read_config(directory)
    cfg = dataclasses.replace(cfg, **overrides)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found: the checkpoint in {directory} is incomplete")
    try:
        state = load_file(str(weights), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{weights}: corrupted or truncated weights file ({exc}); rerun the stage") from exc
    model = GPTModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{weights} does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.to(device).eval(), metadata
