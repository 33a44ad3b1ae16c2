"""pretrain.init: the weights continued pretraining starts from, and the params they must agree with.

`random` (the default) is the book's run: the stage draws fresh weights and nothing here is read.
Otherwise the weights come from
- a GPT-2 name (gpt2-small, gpt2-medium, ...): OpenAI's file pinned in gpt2.weights, found as
  load-gpt2 finds it (base_models.obtain_weights: gpt2.download_dir, the mirror, the Hugging Face
  cache; its sha256 checked) and converted by the same code;
- a model folder (a gptlab checkpoint: config.json, model.safetensors and their manifest, such as
  a copy of an earlier run's models/pretrain) or a models:/NAME/VERSION URI of the MLflow registry,
  read as `gptlab chat --model` reads one (tracking.model_source), its manifest's sha256 checked.

The architecture is the checkpoint's, and the params must describe it, since the stages after
pretrain read them: pretrain.model's emb_dim, n_layers and n_heads (the preset's, or set) and
qkv_bias equal the checkpoint's, its vocabulary is the GPT-2 tokenizer's, it is a language model,
and context_length is at most the checkpoint's (the positional table keeps its first rows).
drop_rate, attention, kernels and vocab_multiple say how it trains, and may differ. Any misfit
is one line naming both values, before the stage opens its run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptlab.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model, read_config, recorded_digests
from gptlab.model.config import GPT2_VOCAB_SIZE, MODEL_PRESETS, ModelConfig, ModelSpec
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import load_hf_weights
from gptlab.paths import PRETRAIN_MODEL
from gptlab.pipeline.base_models import obtain_weights
from gptlab.pipeline.params import Params
from gptlab.pipeline.training_stage import describe_base
from gptlab.schema import ConfigError
from gptlab.tracking.model_source import is_model_uri, model_source

RANDOM = "random"
# What the weights are: params that disagree with the checkpoint here are refused.
MUST_MATCH = ("emb_dim", "n_layers", "n_heads", "qkv_bias")
PRETRAIN_WANTS = (
    "pretrain.init names {name!r}",
    "start from a model folder or a models:/ URI (pretrain.init)",
    "start from a model folder or a models:/NAME/VERSION URI instead (pretrain.init)",
)


@dataclass(frozen=True)
class InitModel:
    """The checkpoint pretrain.init names, read and checked against the params."""

    name: str  # pretrain.init, as params.yaml gives it
    config: ModelConfig  # the checkpoint's architecture
    weights: dict[str, torch.Tensor]  # its state dict, on the CPU
    sha256: str  # of the weights file read: OpenAI's pin, or the checkpoint's manifest
    metadata: dict[str, Any]  # what describe_base reads: the source, or the checkpoint's own metadata
    # A model folder and its metadata: the run that wrote it is linked as the pretrain run's upstream.
    upstream: tuple[Path, dict[str, Any]] | None = None

    def load_into(self, model: GPTModel) -> None:
        """Copy the weights into `model`, built from the params: the positions cut to its context."""
        positions = self.weights["pos_emb.weight"][: model.cfg.context_length]
        model.load_state_dict({**self.weights, "pos_emb.weight": positions})

    def tags(self) -> dict[str, str]:
        """The pretrain run's tags: what it starts from (the registry's description quotes gptlab.base_model)."""
        return {
            "gptlab.base_model": describe_base(self.name, self.config, self.metadata),
            "gptlab.init": self.name,
            "gptlab.init_sha256": self.sha256,
        }


def initial_model(params: Params) -> InitModel | None:
    """The checkpoint pretrain.init names, checked against pretrain.model; None for random (the book's run)."""
    init = params.pretrain.init
    if init == RANDOM:
        return None
    found = openai_model(init, params) if init in MODEL_PRESETS else logged_or_saved_model(init)
    check_fits(params.pretrain.model, found.config, init)
    return found


def openai_model(name: str, params: Params) -> InitModel:
    """OpenAI's pinned GPT-2 weights `name`, converted as load-gpt2 converts them."""
    model = load_hf_weights(obtain_weights(name, params, PRETRAIN_WANTS))
    pin = params.gpt2.weights[name]  # pinned: obtain_weights refuses a name that is not
    metadata = {"source": "huggingface", "repo_id": pin.repo_id, "revision": pin.revision}
    return InitModel(name, model.cfg, model.state_dict(), pin.sha256, metadata)


def logged_or_saved_model(init: str) -> InitModel:
    """A gptlab checkpoint: a model folder, or a models:/ URI downloaded for the time it is read."""
    if not is_model_uri(init):
        folder = Path(init)
        if folder.resolve() == PRETRAIN_MODEL.resolve():
            raise ConfigError(
                f"pretrain.init: {init} is what this stage writes; copy it first "
                f"(cp -r {PRETRAIN_MODEL} models/base) and name the copy"
            )
        if not (folder / CONFIG_FILE).is_file():
            raise ConfigError(
                f"pretrain.init: {init!r} is not random, a GPT-2 name ({', '.join(MODEL_PRESETS)}), "
                f"a models:/NAME/VERSION URI, or a model folder (no {folder / CONFIG_FILE})"
            )
    with model_source(init, PRETRAIN_MODEL) as source:
        config, _ = read_config(source.checkpoint)
        check_fits_vocabulary(config, init)  # before reading the weights
        model, metadata = load_model(source.checkpoint)
        sha256 = recorded_digests(source.checkpoint)[WEIGHTS_FILE]
    upstream = None if is_model_uri(init) else (Path(init), metadata)
    return InitModel(init, model.cfg, model.state_dict(), sha256, metadata, upstream)


def check_fits_vocabulary(found: ModelConfig, init: str) -> None:
    """A language model over GPT-2's tokenizer, or one line saying what it is."""
    if not found.is_language_model:
        raise ConfigError(
            f"pretrain.init: {init} is a classifier (num_classes={found.num_classes}), not a language model; "
            "continue from a pretrained model"
        )
    if found.vocab_size != GPT2_VOCAB_SIZE:
        raise ConfigError(
            f"pretrain.init: the vocabulary of {init} has {found.vocab_size:,} tokens, GPT-2's tokenizer "
            f"{GPT2_VOCAB_SIZE:,}; continue from a model of GPT-2's vocabulary"
        )


def check_fits(spec: ModelSpec, found: ModelConfig, init: str) -> None:
    """Refuse params that describe another model than the checkpoint, naming both values."""
    check_fits_vocabulary(found, init)
    wanted = spec.resolve()
    for key in MUST_MATCH:
        ours, theirs = getattr(wanted, key), getattr(found, key)
        if ours != theirs:
            preset = f" (preset {spec.preset})" if getattr(spec, key) is None else ""
            raise ConfigError(
                f"pretrain.model.{key}: {ours}{preset} in params, but {theirs} in the init model {init}; "
                f"set it to {theirs}"
            )
    if wanted.context_length > found.context_length:
        raise ConfigError(
            f"pretrain.model.context_length: {wanted.context_length} in params exceeds the "
            f"{found.context_length} positions of the init model {init}; set it to {found.context_length} or less"
        )
