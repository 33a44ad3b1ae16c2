"""The fine-tunes' base models (stage load-gpt2): OpenAI's pinned GPT-2 weights or this pipeline's own
pretrained model, converted into gptlab checkpoints that compute as our pretrained model does, and
checked on The Verdict as the book checks them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.data.fetch import mirror_dir, sha256_file
from gptlab.data.hub_weights import resolve_weights, weights_url
from gptlab.data.inputs import WEIGHTS_SUBDIR
from gptlab.data.verdict import GPTDatasetV1, load_split
from gptlab.errors import InputError
from gptlab.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, cpu_weights, read_config, save_weights
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import load_hf_weights, roundtrip_checkpoint
from gptlab.paths import GPT2_MODELS, PRETRAIN_MODEL
from gptlab.pipeline.params import Params, PretrainData
from gptlab.schema import ConfigError, build
from gptlab.training.losses import split_losses


@dataclass(frozen=True)
class Pretrained:
    """What load-gpt2 takes of our pretrained model, all from the checkpoint's config.json."""

    config: ModelConfig  # its attention and kernels: how every base model computes
    metadata: dict[str, Any]
    windows: PretrainData  # The Verdict's windows it was trained on: every base model is scored on them


def read_pretrained(directory: Path = PRETRAIN_MODEL) -> Pretrained:
    """The pretrain checkpoint's config and the params its stage recorded in it; a clear error if missing."""
    config, metadata = read_config(directory)
    recorded = metadata.get("params", {})
    keys = {"max_length": "pretrain.data.max_length", "stride": "pretrain.data.stride"}
    missing = [key for key in keys.values() if key not in recorded]
    if missing:
        raise InputError(
            f"{directory / CONFIG_FILE}: its metadata lacks params {missing} (the pretrain stage records "
            "them): run the pretrain stage again"
        )
    windows = build(PretrainData, {name: recorded[key] for name, key in keys.items()}, "pretrain.data")
    return Pretrained(config, metadata, windows)


def base_model_names(params: Params) -> list[str]:
    """The distinct base models the fine-tune stages ask for, in a stable order."""
    return sorted({params.spam.base_model, params.instruct.base_model})


# Who asks for OpenAI's weights, and their way out without them: the fine-tunes' base models by default.
FINE_TUNES_WANT = (
    "a fine-tune names {name!r} as its base model",
    "set gpt2.source: pretrain",
    "run fully offline on this pipeline's own pretrained model: set `gpt2.source: pretrain` "
    "in params.yaml (the fine-tunes then start from models/pretrain)",
)


def obtain_weights(name: str, params: Params, wanted: tuple[str, str, str] = FINE_TUNES_WANT) -> Path:
    """OpenAI's pinned weights file for `name`: present, mirror, then the HF cache; FetchError says what to do.

    `wanted` says who asks for them, and the key to set instead when unpinned or unreachable.
    """
    asker, unpinned, unreachable = wanted
    if name not in params.gpt2.weights:
        raise ConfigError(
            f"gpt2.weights.{name}: missing key; {asker.format(name=name)}, so pin its "
            f"weights here (known: {sorted(params.gpt2.weights)}) or {unpinned}"
        )
    pin = params.gpt2.weights[name]
    mirror = mirror_dir()
    return resolve_weights(
        pin,
        f"gpt2.weights.{name}",
        Path(params.gpt2.download_dir) / name / pin.filename,
        mirror / WEIGHTS_SUBDIR / name / pin.filename if mirror else None,
        or_else=unreachable,
    ).path


def import_base_model(name: str, params: Params, weights: Path | None) -> tuple[GPTModel, dict[str, Any]]:
    """The base model `name` and the metadata that records where it came from."""
    if params.gpt2.source == "huggingface":
        assert weights is not None, "huggingface source needs its weights file"
        pin = params.gpt2.weights[name]
        metadata = {
            "stage": "load-gpt2",
            "source": "huggingface",
            "name": name,
            "url": weights_url(pin),
            **dataclasses.asdict(pin),
        }
        return load_hf_weights(weights), metadata
    metadata = {
        "stage": "load-gpt2",
        "source": "pretrain",
        "name": name,
        "checkpoint": PRETRAIN_MODEL.as_posix(),
        "checkpoint_sha256": sha256_file(PRETRAIN_MODEL / WEIGHTS_FILE),
        "head": "the checkpoint's own out_head, kept through export -> import (same logits)",
    }
    return roundtrip_checkpoint(PRETRAIN_MODEL), metadata


def write_base_model(name: str, params: Params, weights: Path | None, kernels: ModelConfig) -> dict[str, Any]:
    """models/gpt2/<name>, computing with the attention and kernels of `kernels`; returns its metadata."""
    model, metadata = import_base_model(name, params, weights)
    cfg = dataclasses.replace(model.cfg, attention=kernels.attention, kernels=kernels.kernels)
    save_weights(cpu_weights(model), cfg, GPT2_MODELS / name, metadata)
    return metadata


def verdict_losses(model: GPTModel, params: Params, windows: PretrainData, desc: str) -> dict[str, float]:
    """Loss and perplexity on The Verdict's splits, in order, every window (the eval stage's names)."""
    if windows.max_length > model.cfg.context_length:
        raise InputError(
            f"pretrain.data.max_length={windows.max_length} exceeds the context length "
            f"{model.cfg.context_length} of {desc}; lower it"
        )
    datasets = {
        split: GPTDatasetV1(load_split(params.data.processed_dir, split), windows.max_length, windows.stride)
        for split in ("train", "val")
    }
    return split_losses(model, datasets, params.gpt2.batch_size, desc=desc)
