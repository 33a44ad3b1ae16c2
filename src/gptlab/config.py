"""Typed, frozen configuration built from params.yaml.

Every section of params.yaml maps onto a dataclass below. Unknown keys, missing
keys and wrong types are refused before any work starts, with the key path and
what was expected, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from gptlab.errors import InputError

T = TypeVar("T")

PARAMS_FILE = Path("params.yaml")


class ConfigError(InputError):
    """A params.yaml value that cannot be used; the message names the key."""


# --------------------------------------------------------------------------- #
# Model architecture
# --------------------------------------------------------------------------- #

GPT2_VOCAB_SIZE = 50257

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
    # None: the language-model head over the vocabulary (no bias). An integer: a
    # classification head with that many outputs (with bias), as in chapter 6.
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if self.num_classes is not None and self.num_classes < 2:
            raise ConfigError(f"model.num_classes: expected at least 2 or null, got {self.num_classes}")
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}: expected a positive integer, got {getattr(self, name)}")
        if self.emb_dim % self.n_heads:
            raise ConfigError(
                f"model.emb_dim: {self.emb_dim} is not divisible by n_heads={self.n_heads}; "
                "pick an emb_dim that is a multiple of n_heads"
            )
        if not 0.0 <= self.drop_rate < 1.0:
            raise ConfigError(f"model.drop_rate: expected a value in [0, 1), got {self.drop_rate}")

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
    emb_dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None

    def __post_init__(self) -> None:
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
            **overrides,
        )


# --------------------------------------------------------------------------- #
# Training (one loop for all three training stages)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of the shared training loop. Defaults in params.yaml follow the book."""

    batch_size: int
    epochs: int
    lr: float
    weight_decay: float
    eval_freq: int
    eval_iter: int
    seed: int
    # Off by default for fidelity to the book.
    grad_clip: float | None
    warmup_steps: int
    lr_schedule: Literal["constant", "cosine"]
    min_lr: float
    # "auto" picks cuda, then mps, then cpu.
    device: Literal["auto", "cpu", "cuda", "mps"]
    precision: Literal["fp32", "bf16"]
    # Same maths as the default AdamW, an order of magnitude faster on CPU (see FACTS).
    fused_adamw: bool
    checkpoint_every: int
    keep_checkpoints: int
    # Stop after this many optimizer steps (smoke runs); null trains all epochs.
    max_steps: int | None

    def __post_init__(self) -> None:
        positive = (
            "batch_size",
            "epochs",
            "eval_freq",
            "eval_iter",
            "checkpoint_every",
            "keep_checkpoints",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}: expected a positive integer, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr: expected a positive float, got {self.lr}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ConfigError(f"train.max_steps: expected a positive integer or null, got {self.max_steps}")


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class SourceFile:
    """One external input, pinned by URL and sha256.

    `path` is where it lands under data.raw_dir and where it lies in a mirror
    folder; `member` names the file to take out of a zip download.
    """

    url: str
    sha256: str
    path: str
    member: str | None = None

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ConfigError(f"sha256 {self.sha256!r} of {self.path}: expected 64 lowercase hex digits")


@dataclass(frozen=True)
class Sources:
    the_verdict: SourceFile
    sms_spam: SourceFile
    instruction_data: SourceFile
    gpt2_vocab_bpe: SourceFile
    gpt2_encoder_json: SourceFile


@dataclass(frozen=True)
class DataConfig:
    raw_dir: str
    processed_dir: str
    sources: Sources


@dataclass(frozen=True)
class VerdictSplit:
    train_ratio: float


@dataclass(frozen=True)
class SpamSplit:
    seed: int
    train_frac: float
    val_frac: float
    # Keep only this many rows of each split (smoke runs); null keeps all.
    max_rows: int | None


@dataclass(frozen=True)
class InstructSplit:
    train_frac: float
    test_frac: float
    max_records: int | None


@dataclass(frozen=True)
class TokenizeConfig:
    verdict: VerdictSplit
    spam: SpamSplit
    instruct: InstructSplit


# --------------------------------------------------------------------------- #
# Stages
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class SampleConfig:
    """One generated continuation; temperature 0 means greedy."""

    prompt: str
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int


@dataclass(frozen=True)
class PretrainData:
    max_length: int
    stride: int


@dataclass(frozen=True)
class PretrainConfig:
    model: ModelSpec
    data: PretrainData
    train: TrainConfig
    sample: SampleConfig


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int
    samples: dict[str, SampleConfig]


@dataclass(frozen=True)
class HFWeights:
    """OpenAI's GPT-2 weights on the Hugging Face hub, pinned by revision and sha256."""

    repo_id: str
    revision: str
    filename: str
    sha256: str
    size: int | None


@dataclass(frozen=True)
class Gpt2Config:
    # huggingface: OpenAI's weights; pretrain: this pipeline's own checkpoint (offline).
    source: Literal["huggingface", "pretrain"]
    download_dir: str
    weights: dict[str, HFWeights]
    batch_size: int
    sample: SampleConfig


@dataclass(frozen=True)
class SpamConfig:
    base_model: str
    # What trains: the new head only, the last `trainable_blocks` blocks + final norm + head, or all.
    trainable: Literal["head", "last_blocks", "all"]
    trainable_blocks: int
    pooling: Literal["last", "mean"]
    drop_rate: float
    train: TrainConfig


@dataclass(frozen=True)
class JudgeConfig:
    enabled: bool
    api: Literal["ollama", "openai"]
    url: str
    model: str
    timeout_s: float
    # Send GPTLAB_JUDGE_API_KEY over plain http:// to a host other than this machine.
    allow_insecure_http: bool = False

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"judge.url: expected an http:// or https:// URL, got {self.url!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"judge.timeout_s: expected a positive number of seconds, got {self.timeout_s}")


@dataclass(frozen=True)
class InstructConfig:
    base_model: str
    drop_rate: float
    allowed_max_length: int
    mask_prompt: bool
    max_new_tokens: int
    train: TrainConfig
    judge: JudgeConfig


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str


@dataclass(frozen=True)
class Params:
    """The whole of params.yaml."""

    tracking: TrackingConfig
    data: DataConfig
    tokenize: TokenizeConfig
    pretrain: PretrainConfig
    eval: EvalConfig
    gpt2: Gpt2Config
    spam: SpamConfig
    instruct: InstructConfig


# --------------------------------------------------------------------------- #
# Building typed configs from plain YAML data
# --------------------------------------------------------------------------- #


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raises ConfigError naming the first bad key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run from the project root, where params.yaml lives")
    with path.open(encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return build(Params, data, "")


def build(cls: type[T], data: Any, path: str) -> T:
    """Build dataclass `cls` from a mapping, checking every key and type."""
    where = path or "params.yaml"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{_join(path, str(unknown[0]))}: unknown key; expected one of {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        key = _join(path, name)
        if name not in data:
            no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if no_default:
                raise ConfigError(f"{key}: missing key")
            continue
        kwargs[name] = _convert(data[name], hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ messages name keys by their section ("train.lr: ..."); give the full path.
        message, section = str(exc), path.rpartition(".")[2]
        if section and message.startswith(f"{section}."):
            raise ConfigError(_join(path, message[len(section) + 1 :])) from None
        raise ConfigError(f"{path}: {message}" if path else message) from None


def _convert(value: Any, annotation: Any, key: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(value, option, key)
            except ConfigError as exc:
                errors.append(exc)
        expected = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {expected}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {_describe(value)}")
        return value
    if origin is dict:
        key_type, value_type = args
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {_describe(value)}")
        return {
            _convert(k, key_type, key): _convert(v, value_type, _join(key, str(k))) for k, v in value.items()
        }
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_describe(value)}")
        return [_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, key)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if annotation is float:
        # YAML reads 5e-5 (no dot) as a string; accept it as the number it obviously is.
        number = value
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ConfigError(f"{key}: expected a float, got {_describe(value)}")
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite float, got {_describe(value)}")
        return float(number)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
        return value
    raise AssertionError(f"{key}: config type {annotation!r} is not supported by the loader")


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Flat `section.key` view of a config, as logged to MLflow."""
    items = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    flat: dict[str, Any] = {}
    for name, value in items.items():
        key = _join(prefix, str(name))
        if isinstance(value, Mapping):
            flat.update(flatten(value, key))
        else:
            flat[key] = value
    return flat


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    return {int: "an integer", float: "a float", str: "a string", bool: "true or false"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)
