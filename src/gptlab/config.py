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

from gptlab.architecture import GPT2_VOCAB_SIZE, MAX_CONTEXT_LENGTH, MAX_DIMS, MODEL_PRESETS, ModelConfig
from gptlab.files import require_file
from gptlab.typed_config import ConfigError, build, renamed, require
from gptlab.yaml_files import read_yaml

PARAMS_FILE = Path("params.yaml")

# Caps on the params that size memory or work, named in each refusal: far above any setting that
# runs on one machine, so a typo (an extra few zeros) stops at load, not minutes into a stage.
MAX_BATCH_SIZE = 65536
MAX_ROUNDS = 10_000  # epochs, evaluation batches
MAX_NEW_TOKENS = 10_000
MAX_NAME_LENGTH = 250  # MLflow experiment and run names
# Sampling temperatures: below the floor, logits / temperature overflow to inf; 0 is greedy.
TEMPERATURE_RANGE = (0.01, 100.0)

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
    # Score each evaluation's eval_iter batches in one forward pass: the mean over their examples,
    # which is the book's mean of per-batch means while the batches are full and count the same
    # number of targets (pretrain, spam); a token-weighted mean where padding varies (instruct).
    eval_in_one_pass: bool = False

    def __post_init__(self) -> None:
        require(self.eval_freq > 0, "eval_freq", f"expected a positive integer, got {self.eval_freq}")
        for name, cap in (("epochs", MAX_ROUNDS), ("eval_iter", MAX_ROUNDS)):
            require_count(getattr(self, name), name, cap)
        require_count(self.batch_size, "batch_size", MAX_BATCH_SIZE)
        if self.eval_batch_size is not None:
            require_count(self.eval_batch_size, "eval_batch_size", MAX_BATCH_SIZE, " or null")
        require(
            not self.eval_in_one_pass or self.rng == "per_epoch",
            "eval_in_one_pass",
            "needs rng: per_epoch (under rng: book evaluation reads the shuffled training loader, batch by batch)",
        )
        require(self.lr > 0, "lr", f"expected a positive float, got {self.lr}")
        # AdamW's step moves each weight by about lr; beyond 1, training can only diverge.
        require(self.lr <= 1, "lr", f"expected a value in (0, 1], got {self.lr:g}")
        require(self.weight_decay >= 0, "weight_decay", f"expected 0 or more, got {self.weight_decay}")
        require(
            self.weight_decay <= 1,
            "weight_decay",
            f"expected a value in [0, 1] (each step scales the weights by 1 - lr * weight_decay), "
            f"got {self.weight_decay:g}",
        )
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
        if not is_sha256(self.sha256):
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
    samples: dict[str, SampleConfig]

    def __post_init__(self) -> None:
        require_count(self.batch_size, "batch_size", MAX_BATCH_SIZE)


@dataclass(frozen=True)
class HFWeights:
    """OpenAI's GPT-2 weights on the Hugging Face hub, pinned by revision and sha256."""

    repo_id: str
    revision: str
    filename: str
    sha256: str
    size: int | None

    def __post_init__(self) -> None:
        # Checked before a download of up to 1.5 GB starts, which could only end refused.
        require(is_sha256(self.sha256), "sha256", f"expected 64 lowercase hex digits, got {self.sha256!r}")
        require(
            self.size is None or self.size > 0,
            "size",
            f"expected a positive number of bytes or null, got {self.size}",
        )


@dataclass(frozen=True)
class Gpt2Config:
    # huggingface: OpenAI's weights; pretrain: this pipeline's own checkpoint (offline).
    source: Literal["huggingface", "pretrain"]
    download_dir: str
    weights: dict[str, HFWeights]
    batch_size: int
    sample: SampleConfig

    def __post_init__(self) -> None:
        require_count(self.batch_size, "batch_size", MAX_BATCH_SIZE)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (appendix E): rank of A and B, and alpha; the update is scaled by alpha / rank."""

    rank: int
    alpha: float

    def __post_init__(self) -> None:
        require_count(self.rank, "rank", MAX_DIMS["emb_dim"])
        require(self.alpha > 0, "alpha", f"expected a positive number, got {self.alpha}")
        require(self.alpha <= 10_000, "alpha", f"expected a value in (0, 10000], got {self.alpha:g}")


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
        require_count(self.initial_eval_batches, "initial_eval_batches", MAX_ROUNDS)
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
        if not 0 < self.timeout_s <= 86400:
            raise ConfigError(
                f"judge.timeout_s: expected a positive number of seconds, at most 86400 (a day), "
                f"got {self.timeout_s:g}"
            )


@dataclass(frozen=True)
class AnswerGeneration:
    """How the test answers are generated: `batch_size` records at once (1: one by one, as the book)."""

    batch_size: int
    # The answering weights: fp32 (the book), or a bf16 copy (auto: where bf16 is fast), 1.1-1.3x faster.
    precision: Literal["fp32", "bf16", "auto"] = "fp32"

    def __post_init__(self) -> None:
        require_count(self.batch_size, "batch_size", MAX_BATCH_SIZE)


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
        require_count(self.max_new_tokens, "max_new_tokens", MAX_NEW_TOKENS)


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

    def __post_init__(self) -> None:
        for name in ("experiment", "sweep", "sweep_variant"):
            value = getattr(self, name)
            if value is not None:  # experiment is always set; the sweep's two only by `gptlab sweep`
                require(
                    value.strip() != "" and len(value) <= MAX_NAME_LENGTH,
                    name,
                    f"expected a name of 1 to {MAX_NAME_LENGTH} characters, got "
                    + (repr(value) if len(value) <= MAX_NAME_LENGTH else f"{len(value):,} characters"),
                )


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

    def __post_init__(self) -> None:
        # What spam trains and reads must fit its base model, known here for GPT-2's presets and,
        # with gpt2.source pretrain, for this pipeline's own model.
        layers, context = self._base_model_size(self.spam.base_model)
        name = f"spam.base_model {self.spam.base_model}"
        if layers is not None:
            require(
                self.spam.trainable_blocks <= layers,
                "spam.trainable_blocks",
                f"expected 1 to {layers} (the blocks of {name}), got {self.spam.trainable_blocks}",
            )
        if isinstance(self.spam.max_length, int):
            require(
                self.spam.max_length <= context,
                "spam.max_length",
                f"expected 1 to {context} (the context length of {name}), got {self.spam.max_length}",
            )

    def _base_model_size(self, name: str) -> tuple[int | None, int]:
        """Blocks (None if unknown before load-gpt2 runs) and context length of base model `name`."""
        if self.gpt2.source == "pretrain":
            model = self.pretrain.model.resolve()
            return model.n_layers, model.context_length
        return MODEL_PRESETS.get(name, {}).get("n_layers"), MAX_CONTEXT_LENGTH


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raises ConfigError naming the first bad key."""
    path = require_file(
        Path(path), "a params file", f"{path} not found: run from the project root, where params.yaml lives"
    )
    try:
        data = read_yaml(path)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return build(Params, data, "")


def require_count(value: int, field: str, cap: int, alternative: str = "") -> None:
    """A count in [1, cap] (`alternative`, e.g. " or null", is named in the refusal)."""
    require(value > 0, field, f"expected a positive integer{alternative}, got {value}")
    require(value <= cap, field, f"expected 1 to {cap}{alternative}, got {value}")


def is_sha256(value: str) -> bool:
    """64 lowercase hex digits, as sha256sum prints a digest."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _check_fractions(train_frac: float, other_frac: float, other: str, *, rest: str) -> None:
    """Both fractions in (0, 1) and summing below 1, so the `rest` split (what is left) is not empty."""
    require(0 < train_frac < 1, "train_frac", f"expected a value in (0, 1), got {train_frac}")
    require(
        0 < other_frac < 1 - train_frac,
        other,
        f"expected a value in (0, {1 - train_frac:g}), so that train_frac + {other} stays below 1 "
        f"and the {rest} split is not empty, got {other_frac}",
    )
