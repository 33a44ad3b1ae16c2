"""Model checkpoints: weights as safetensors plus a JSON of the config and metadata.

The model's config travels with its weights, so downstream stages rebuild the
model from the checkpoint alone, never by re-reading another stage's params.
Files are written to a temporary name and renamed, so a crash never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.config import ConfigError, ModelConfig
from gptlab.model import GPTModel

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path beside `target` that replaces it only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with tmp_path.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


def save_model(model: GPTModel, directory: Path | str, metadata: dict[str, Any] | None = None) -> Path:
    """Write `model.safetensors` and `config.json` into `directory`; returns the directory."""
    directory = Path(directory)
    # Tensors must be contiguous and unshared for safetensors; clone breaks tied weights.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    payload = {"model": model.cfg.to_dict(), "metadata": metadata or {}}
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
        raise ValueError(f"{path}: not a valid gptlab checkpoint config ({exc})") from exc


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
        raise ValueError(f"{weights}: corrupted or truncated weights file ({exc}); rerun the stage") from exc
    model = GPTModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{weights} does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.to(device).eval(), metadata
