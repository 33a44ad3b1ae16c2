"""The architecture of a GPTModel and GPT-2's published sizes; saved beside every checkpoint.

Kept apart from the model code (no torch here) so that params can be checked,
and checkpoints described, without building a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gptlab.schema import MAX_NEW_TOKENS, TEMPERATURE_RANGE, ConfigError, build, require, require_count

GPT2_VOCAB_SIZE = 50257
# GPT-2's learned positions (n_positions): the longest context any of its models reads.
MAX_CONTEXT_LENGTH = 1024

# Explicit caps on what sizes a model, so absurd params or a damaged config.json are refused before
# any tensor is allocated: well above GPT-2 XL (48 layers, 1,600 dims, 1.6 billion parameters).
MAX_DIMS = {
    "vocab_size": 1 << 20,
    "context_length": 1 << 16,
    "emb_dim": 8192,
    "n_heads": 8192,
    "n_layers": 256,
}
MAX_PARAMETERS = 4_000_000_000
# The largest `vocab_multiple` accepted: past the widths GPU matmuls tile by, padding only adds rows.
MAX_VOCAB_MULTIPLE = 1024

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt2-small": {"emb_dim": 768, "n_layers": 12, "n_heads": 12},
    "gpt2-medium": {"emb_dim": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-large": {"emb_dim": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-xl": {"emb_dim": 1600, "n_layers": 48, "n_heads": 25},
}


@dataclass(frozen=True)
class ModelConfig:
    """The complete architecture of a GPTModel; saved beside every checkpoint."""

    vocab_size: int = GPT2_VOCAB_SIZE
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False
    # How attention is computed; same maths, different speed (see benchmarks/).
    attention: Literal["sdpa", "masked_softmax"] = "sdpa"
    # book: the book's LayerNorm, GELU and three Q/K/V matmuls; fused: torch's layer norm and
    # tanh-GELU kernels, one Q/K/V matmul and cheaper dropout masks on the CPU (same maths to
    # ~1e-6, other random draws, same parameter names).
    kernels: Literal["book", "fused"] = "book"
    # None: the language-model head over the vocabulary (no bias). An integer: a
    # classification head with that many outputs (with bias), as in chapter 6.
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if self.num_classes is not None and not 2 <= self.num_classes <= MAX_DIMS["vocab_size"]:
            raise ConfigError(
                f"model.num_classes: expected at least 2 (at most {MAX_DIMS['vocab_size']}) or null, "
                f"got {self.num_classes}"
            )
        for name, cap in MAX_DIMS.items():
            if not 0 < getattr(self, name) <= cap:
                raise ConfigError(f"model.{name}: expected 1 to {cap}, got {getattr(self, name)}")
        if self.emb_dim % self.n_heads:
            raise ConfigError(
                f"model.emb_dim: {self.emb_dim} is not divisible by n_heads={self.n_heads}; "
                "pick an emb_dim that is a multiple of n_heads"
            )
        if not 0.0 <= self.drop_rate < 1.0:
            raise ConfigError(f"model.drop_rate: expected a value in [0, 1), got {self.drop_rate}")
        if self.parameter_count() > MAX_PARAMETERS:
            raise ConfigError(
                f"model.emb_dim: {self.emb_dim} with n_layers={self.n_layers} and vocab_size={self.vocab_size} "
                f"makes {self.parameter_count():,} parameters, over the cap of {MAX_PARAMETERS:,}"
            )

    @property
    def is_language_model(self) -> bool:
        """Whether the head predicts the next token (no `num_classes`: not a chapter 6 classifier)."""
        return self.num_classes is None

    def parameter_count(self) -> int:
        """The model's parameters, from its dims alone (nothing allocated): embeddings, blocks, head."""
        dim, blocks = self.emb_dim, self.n_layers
        per_block = 12 * dim * dim + (10 + 3 * self.qkv_bias) * dim  # Q/K/V, output, 4x MLP; biases, 2 norms
        head = self.vocab_size * dim if self.num_classes is None else (dim + 1) * self.num_classes
        return (self.vocab_size + self.context_length) * dim + blocks * per_block + 2 * dim + head

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in MODEL_PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        return build(cls, data, "model")


@dataclass(frozen=True)
class ModelSpec:
    """A model as params.yaml names it: a preset plus the knobs the book sets per chapter.

    emb_dim / n_layers / n_heads override the preset (tiny models for tests and
    the smoke profile); leave them null for the real thing.
    """

    preset: str
    context_length: int
    drop_rate: float
    qkv_bias: bool
    attention: Literal["sdpa", "masked_softmax"]
    kernels: Literal["book", "fused"]
    emb_dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    # Training only: the output head padded to a multiple of this many rows (64: 50,257 to 50,304), a
    # size GPU matmuls tile evenly; never in the loss, the samples or the checkpoint. null: unpadded.
    vocab_multiple: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_multiple is not None:
            require_count(self.vocab_multiple, "vocab_multiple", MAX_VOCAB_MULTIPLE, " or null")
        require(
            0 < self.context_length <= MAX_CONTEXT_LENGTH,
            "context_length",
            f"expected 1 to {MAX_CONTEXT_LENGTH} (GPT-2's positions), got {self.context_length}",
        )
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(
                f"model.preset: unknown preset {self.preset!r}; choose one of {sorted(MODEL_PRESETS)}"
            )
        # Check the architecture now (e.g. emb_dim divisible by n_heads), before any work starts.
        self.resolve()

    def resolve(self) -> ModelConfig:
        overrides = {
            k: v
            for k, v in (
                ("emb_dim", self.emb_dim),
                ("n_layers", self.n_layers),
                ("n_heads", self.n_heads),
            )
            if v is not None
        }
        return ModelConfig.from_preset(
            self.preset,
            context_length=self.context_length,
            drop_rate=self.drop_rate,
            qkv_bias=self.qkv_bias,
            attention=self.attention,
            kernels=self.kernels,
            **overrides,
        )


@dataclass(frozen=True)
class SampleConfig:
    """One generated continuation; temperature 0 means greedy."""

    prompt: str
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int

    def __post_init__(self) -> None:
        require(self.max_new_tokens >= 0, "max_new_tokens", f"expected 0 or more, got {self.max_new_tokens}")
        require(
            self.max_new_tokens <= MAX_NEW_TOKENS,
            "max_new_tokens",
            f"expected 0 to {MAX_NEW_TOKENS}, got {self.max_new_tokens}",
        )
        low, high = TEMPERATURE_RANGE
        require(
            self.temperature == 0 or low <= self.temperature <= high,
            "temperature",
            f"expected 0 (greedy) or a positive float from {low:g} to {high:g}, got {self.temperature:g}",
        )
        if self.top_k is not None:  # torch.topk cannot pick more tokens than the vocabulary has
            require_count(self.top_k, "top_k", GPT2_VOCAB_SIZE, " or null")
