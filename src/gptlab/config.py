"""The schema of params.yaml: one frozen dataclass per section, and its loader.

Every section of params.yaml maps onto a dataclass below, built by
`gptlab.typed_config`, so unknown keys, missing keys and wrong types are
refused before any work starts, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import yaml

from gptlab.architecture import MAX_CONTEXT_LENGTH, MODEL_PRESETS, ModelConfig
from gptlab.typed_config import ConfigError, build, renamed, require

PARAMS_FILE = Path("params.yaml")

# The allowed values of spam.trainable and spam.pooling, named once: gptlab.classifier takes these words.
Trainable = Literal["head", "last_blocks", "all", "lora"]
Pooling = Literal["last", "first", "mean", "mean_all"]


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

    def __post_init__(self) -> None:
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


# --------------------------------------------------------------------------- #
# Training (one loop for all three training stages)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of the shared training loop. Defaults in params.yaml follow the book."""

    # Saving is operational, no training setting: its keys moved to their own section.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "checkpoint_every": "checkpoints.every_steps",
        "checkpoint_minutes": "checkpoints.every_minutes",
        "keep_checkpoints": "checkpoints.keep",
    }

    batch_size: int
    epochs: int
    lr: float
    weight_decay: float
    eval_freq: int
    eval_iter: int
    seed: int
    # book: randomness drawn exactly as the book's scripts draw it (shuffled loaders on the global
    # RNG, the stage seeding where the chapter does); per_epoch: each epoch's order from its own
    # generator (seed + epoch), loaders never touching the global RNG; what torchrun uses.
    rng: Literal["book", "per_epoch"]
    # Off by default for fidelity to the book.
    grad_clip: float | None
    warmup_steps: int
    lr_schedule: Literal["constant", "cosine"]
    min_lr: float
    # "auto" picks cuda, then mps, then cpu.
    device: Literal["auto", "cpu", "cuda", "mps"]
    # auto: bf16 autocast where bf16 is fast (AMX / AVX-512 BF16 CPUs, CUDA GPUs), fp32 elsewhere.
    precision: Literal["fp32", "bf16", "auto"]
    # Same maths as the default AdamW, an order of magnitude faster on CPU (see FACTS).
    fused_adamw: bool
    # book: logits then F.cross_entropy; chunked: head and cross entropy fused a chunk of tokens at a
    # time, never materialising all logits (next-token stages; see gptlab.chunked_loss).
    loss_kernel: Literal["book", "chunked"]
    # Train through torch.compile (first step pays a compile of ~1 min on CPU).
    compile: bool
    # Stop after this many optimizer steps (smoke runs); null trains all epochs.
    max_steps: int | None
    # Batch size of full-split losses; null: the training batch, as the book (it averages
    # per-batch means, so another size changes the number).
    eval_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "epochs",
            "eval_freq",
            "eval_iter",
        ):
            require(getattr(self, name) > 0, name, f"expected a positive integer, got {getattr(self, name)}")
        require(
            self.eval_batch_size is None or self.eval_batch_size > 0,
            "eval_batch_size",
            f"expected a positive integer or null, got {self.eval_batch_size}",
        )
        require(self.lr > 0, "lr", f"expected a positive float, got {self.lr}")
        require(self.weight_decay >= 0, "weight_decay", f"expected 0 or more, got {self.weight_decay}")
        require(
            self.grad_clip is None or self.grad_clip > 0,
            "grad_clip",
            f"expected a positive max gradient norm or null (off), got {self.grad_clip}",
        )
        require(self.warmup_steps >= 0, "warmup_steps", f"expected 0 or more, got {self.warmup_steps}")
        require(
            0 <= self.min_lr <= self.lr,
            "min_lr",
            f"expected a value in [0, lr={self.lr}] (the cosine schedule's floor), got {self.min_lr}",
        )
        require(
            self.max_steps is None or self.max_steps > 0,
            "max_steps",
            f"expected a positive integer or null, got {self.max_steps}",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """When the training loop saves its resumable state, and how many saves it keeps.

    Operational: saving changes no number, so these are part of no stage's DVC params
    and of no resume fingerprint; changing them between a crash and its rerun still resumes.
    """

    # Every this many optimizer steps and at epoch ends; null: by time only.
    every_steps: int | None
    # Once this many minutes have passed since the last save; null: by steps only.
    every_minutes: float | None
    keep: int

    def __post_init__(self) -> None:
        for name in ("every_steps", "every_minutes"):
            value = getattr(self, name)
            require(value is None or value > 0, name, f"expected a positive number or null, got {value}")
        require(
            self.every_steps is not None or self.every_minutes is not None,
            "every_steps",
            "every_steps and every_minutes are both null: set one, so a crash can resume",
        )
        require(self.keep > 0, "keep", f"expected a positive integer, got {self.keep}")


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

    def bpe_files(self) -> tuple[Path, Path]:
        """GPT-2's vocab.bpe and encoder.json as the download stage leaves them."""
        raw = Path(self.raw_dir)
        return raw / self.sources.gpt2_vocab_bpe.path, raw / self.sources.gpt2_encoder_json.path


@dataclass(frozen=True)
class VerdictSplit:
    train_ratio: float

    def __post_init__(self) -> None:
        require(
            0 < self.train_ratio < 1, "train_ratio", f"expected a value in (0, 1), got {self.train_ratio}"
        )


@dataclass(frozen=True)
class SpamSplit:
    seed: int
    train_frac: float
    val_frac: float
    # Keep only this many rows of each split (smoke runs); null keeps all.
    max_rows: int | None

    def __post_init__(self) -> None:
        _check_fractions(self.train_frac, self.val_frac, "val_frac", rest="test")
        require(
            self.max_rows is None or self.max_rows > 0,
            "max_rows",
            f"expected a positive integer or null, got {self.max_rows}",
        )


@dataclass(frozen=True)
class InstructSplit:
    train_frac: float
    test_frac: float
    max_records: int | None

    def __post_init__(self) -> None:
        _check_fractions(self.train_frac, self.test_frac, "test_frac", rest="validation")
        require(
            self.max_records is None or self.max_records > 0,
            "max_records",
            f"expected a positive integer or null, got {self.max_records}",
        )


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

    def __post_init__(self) -> None:
        require(self.max_new_tokens >= 0, "max_new_tokens", f"expected 0 or more, got {self.max_new_tokens}")
        require(
            self.temperature >= 0,
            "temperature",
            f"expected 0 (greedy) or a positive float, got {self.temperature}",
        )
        require(
            self.top_k is None or self.top_k > 0,
            "top_k",
            f"expected a positive integer or null, got {self.top_k}",
        )


@dataclass(frozen=True)
class PretrainData:
    max_length: int
    stride: int

    def __post_init__(self) -> None:
        require(self.max_length > 0, "max_length", f"expected a positive integer, got {self.max_length}")
        require(self.stride > 0, "stride", f"expected a positive integer, got {self.stride}")


@dataclass(frozen=True)
class PretrainConfig:
    model: ModelSpec
    data: PretrainData
    train: TrainConfig
    sample: SampleConfig

    def __post_init__(self) -> None:
        require(
            self.data.max_length <= self.model.context_length,
            "data.max_length",
            f"{self.data.max_length} exceeds model.context_length={self.model.context_length}: "
            "the model cannot read windows that long",
        )


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int

    def __post_init__(self) -> None:
        require(self.batch_size > 0, "batch_size", f"expected a positive integer, got {self.batch_size}")

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

    def __post_init__(self) -> None:
        require(self.batch_size > 0, "batch_size", f"expected a positive integer, got {self.batch_size}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (appendix E): rank of A and B, and alpha; the update is scaled by alpha / rank."""

    rank: int
    alpha: float

    def __post_init__(self) -> None:
        require(self.rank > 0, "rank", f"expected a positive integer, got {self.rank}")
        require(self.alpha > 0, "alpha", f"expected a positive number, got {self.alpha}")


@dataclass(frozen=True)
class SpamConfig:
    base_model: str
    # pretrained: the load-gpt2 checkpoint; random: its architecture freshly drawn after seeding
    # train.seed (chapter 6's bonus table, "random weights").
    base_weights: Literal["pretrained", "random"]
    # What trains: the new head only, the last `trainable_blocks` blocks + final norm + head, all,
    # or LoRA adapters on every linear layer (head included) with everything else frozen (appendix E).
    trainable: Trainable
    trainable_blocks: int
    lora: LoraConfig
    # Which outputs classify a message: the last token's (the book), the first token's, the mean
    # over its non-padding tokens, or the mean over every position, padding included (the bonus
    # table's "pooled embeddings").
    pooling: Pooling
    # Tokens each message is padded (or cut) to: null keeps the tokenize stage's length (the longest
    # training message); "context" pads to the base model's context length; or a number.
    max_length: int | Literal["context"] | None
    drop_rate: float
    # Batches of each split scored before training (the book prints them: 10).
    initial_eval_batches: int
    train: TrainConfig

    def __post_init__(self) -> None:
        require(
            self.trainable_blocks > 0,
            "trainable_blocks",
            f"expected a positive integer, got {self.trainable_blocks}",
        )
        require(
            not isinstance(self.max_length, int) or self.max_length > 0,
            "max_length",
            f'expected a positive integer, "context" or null, got {self.max_length}',
        )
        require(0 <= self.drop_rate < 1, "drop_rate", f"expected a value in [0, 1), got {self.drop_rate}")
        require(
            self.initial_eval_batches > 0,
            "initial_eval_batches",
            f"expected a positive integer, got {self.initial_eval_batches}",
        )
        require(
            self.train.loss_kernel == "book",
            "train.loss_kernel",
            "the classification loss has no chunked form; use book",
        )


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
class AnswerGeneration:
    """How the test answers are generated: `batch_size` records at once (1: one by one, as the book)."""

    batch_size: int

    def __post_init__(self) -> None:
        require(self.batch_size > 0, "batch_size", f"expected a positive integer, got {self.batch_size}")


@dataclass(frozen=True)
class InstructConfig:
    base_model: str
    # all: every weight trains (chapter 7); lora: LoRA adapters on every linear layer, the rest frozen.
    trainable: Literal["all", "lora"] = renamed({"full": ("all", "train every weight")})
    lora: LoraConfig
    drop_rate: float
    allowed_max_length: int
    mask_prompt: bool
    max_new_tokens: int
    generate: AnswerGeneration
    train: TrainConfig
    judge: JudgeConfig

    def __post_init__(self) -> None:
        require(0 <= self.drop_rate < 1, "drop_rate", f"expected a value in [0, 1), got {self.drop_rate}")
        require(
            0 < self.allowed_max_length <= MAX_CONTEXT_LENGTH,
            "allowed_max_length",
            f"expected 1 to {MAX_CONTEXT_LENGTH}, got {self.allowed_max_length}",
        )
        require(
            self.max_new_tokens > 0,
            "max_new_tokens",
            f"expected a positive integer, got {self.max_new_tokens}",
        )


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str
    # CPU, memory (and GPU where MLflow can read it) as system/... metrics of every run.
    system_metrics: bool = True
    # Log each trained model as an MLflow model (registered; weights stored once, in it).
    log_models: bool = True
    # Set by `gptlab sweep` on each variant it queues: the fine-tune runs are tagged gptlab.sweep and
    # gptlab.sweep_variant (and named <stage>/<variant>), so the MLflow UI groups a sweep's runs.
    sweep: str | None = None
    sweep_variant: str | None = None


@dataclass(frozen=True)
class Params:
    """The whole of params.yaml."""

    tracking: TrackingConfig
    checkpoints: CheckpointConfig
    data: DataConfig
    tokenize: TokenizeConfig
    pretrain: PretrainConfig
    eval: EvalConfig
    gpt2: Gpt2Config
    spam: SpamConfig
    instruct: InstructConfig


# --------------------------------------------------------------------------- #
# Loading
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


def _check_fractions(train_frac: float, other_frac: float, other: str, *, rest: str) -> None:
    """Both fractions in (0, 1) and summing below 1, so the `rest` split (what is left) is not empty."""
    require(0 < train_frac < 1, "train_frac", f"expected a value in (0, 1), got {train_frac}")
    require(
        0 < other_frac < 1 - train_frac,
        other,
        f"expected a value in (0, {1 - train_frac:g}), so that train_frac + {other} stays below 1 "
        f"and the {rest} split is not empty, got {other_frac}",
    )
