"""The fine-tunes' params: `spam` (chapter 6, LoRA of appendix E) and `instruct` (chapter 7, its judge)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gptlab.model.config import MAX_CONTEXT_LENGTH, MAX_DIMS
from gptlab.schema import (
    MAX_BATCH_SIZE,
    MAX_NEW_TOKENS,
    MAX_ROUNDS,
    ConfigError,
    renamed,
    require,
    require_count,
)
from gptlab.training.config import TrainConfig

# The allowed values of spam.trainable and spam.pooling, named once: gptlab.tasks.classifier takes these words.
# What each mode trains is said once, by gptlab.tasks.fine_tune.select_trainable.
Trainable = Literal["head", "last_blocks", "all", "lora"]


Pooling = Literal["last", "first", "mean", "mean_all"]


def check_trainable_blocks(blocks: int, layers: int | None, base_model: str) -> None:
    """spam.trainable_blocks counts blocks of the base model: 1 to its `layers` (when known).

    Checked when params load, against the blocks they let us know, and again against the
    model the stage actually loads.
    """
    key = "spam.trainable_blocks"
    require(blocks > 0, key, f"expected a positive integer, got {blocks}")
    if layers is not None:
        require(blocks <= layers, key, f"expected 1 to {layers} (the blocks of {base_model}), got {blocks}")


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
    # What trains (gptlab.tasks.fine_tune.select_trainable); trainable_blocks: how many for last_blocks,
    # checked against the base model's blocks by check_trainable_blocks.
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
    # Compute the frozen embeddings and blocks' output once per message where that is exact
    # (gptlab.tasks.frozen_trunk): the same numbers, a fraction of the time. Operational: no
    # number depends on it, so it keeps no run from resuming.
    cache_frozen_trunk: bool
    train: TrainConfig

    def __post_init__(self) -> None:
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


# The Alpaca prompt of an empty instruction, response header included, in GPT-2 tokens (tests check it):
# the least a prompt takes, so allowed_max_length must exceed it for an answer token to fit.
PROMPT_TEMPLATE_TOKENS = 29


def check_allowed_max_length(length: int) -> None:
    """Room for a prompt and an answer: a shorter length trains on no answer token (DPO's loss: NaN)."""
    least = PROMPT_TEMPLATE_TOKENS + 1
    require(
        least <= length <= MAX_CONTEXT_LENGTH,
        "allowed_max_length",
        f"expected {least} to {MAX_CONTEXT_LENGTH}, got {length}: the prompt template alone takes "
        f"{PROMPT_TEMPLATE_TOKENS} tokens, and an answer needs one more",
    )


@dataclass(frozen=True)
class InstructConfig:
    base_model: str
    # all (chapter 7) or lora, as spam.trainable's (gptlab.tasks.fine_tune.select_trainable).
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
        check_allowed_max_length(self.allowed_max_length)
        require_count(self.max_new_tokens, "max_new_tokens", MAX_NEW_TOKENS)


@dataclass(frozen=True)
class PreferenceConfig:
    """The chapter 7 bonus: DPO from the instruct model, against a frozen copy of it."""

    # The DPO loss's inverse temperature: how much the policy's log-ratios against the reference count.
    beta: float
    # all (the notebook) or lora, as instruct.trainable's.
    trainable: Literal["all", "lora"]
    lora: LoraConfig
    drop_rate: float
    allowed_max_length: int
    # The notebook's mask_prompt_tokens: the prompt and the 2 newlines after it leave each
    # response's mean log-probability (which keeps "### Response:\n" in it, as the notebook does).
    mask_prompt: bool
    max_new_tokens: int
    generate: AnswerGeneration
    train: TrainConfig

    def __post_init__(self) -> None:
        require(0 < self.beta <= 100, "beta", f"expected a value in (0, 100], got {self.beta}")
        require(0 <= self.drop_rate < 1, "drop_rate", f"expected a value in [0, 1), got {self.drop_rate}")
        check_allowed_max_length(self.allowed_max_length)
        require_count(self.max_new_tokens, "max_new_tokens", MAX_NEW_TOKENS)
        require(
            self.train.loss_kernel == "book",
            "train.loss_kernel",
            "the DPO loss has no chunked form; use book",
        )
