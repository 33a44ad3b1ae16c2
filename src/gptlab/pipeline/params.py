"""params.yaml: every section's typed config, composed, and its loader.

Each layer defines its own sections (model/config.py, data/config.py, training/config.py,
tasks/config.py, tracking/config.py); the stage-level ones live here. Built by gptlab.schema,
so unknown keys, missing keys and wrong types are refused before any work starts, naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from gptlab.data.config import CorpusConfig, DataConfig, HFWeights, TokenizeConfig
from gptlab.files import require_file
from gptlab.model.config import MAX_CONTEXT_LENGTH, MODEL_PRESETS, ModelSpec, SampleConfig
from gptlab.schema import MAX_BATCH_SIZE, ConfigError, build, read_yaml, require, require_count
from gptlab.tasks.config import InstructConfig, PreferenceConfig, SpamConfig, check_trainable_blocks
from gptlab.tracking.config import TrackingConfig
from gptlab.training.config import CheckpointConfig, DistributedConfig, TrainConfig

PARAMS_FILE = Path("params.yaml")


@dataclass(frozen=True)
class PretrainData:
    max_length: int
    stride: int
    # Each split's losses are scored on this many windows, spread evenly over it (a corpus's
    # fixed sample); null: every window, as the book.
    eval_windows: int | None = None

    def __post_init__(self) -> None:
        require(self.max_length > 0, "max_length", f"expected a positive integer, got {self.max_length}")
        require(self.stride > 0, "stride", f"expected a positive integer, got {self.stride}")
        require(
            self.eval_windows is None or self.eval_windows > 0,
            "eval_windows",
            f"expected a positive integer or null, got {self.eval_windows}",
        )


# pretrain.init as a models:/ URI: a registered version by number, or a logged model's id. Both are
# immutable, so the URI in params.yaml is all DVC needs to see; an alias (@champion) may move.
INIT_MODEL_URI = re.compile(r"models:/([^/@]+/[0-9]+|m-[0-9a-f]+)")


@dataclass(frozen=True)
class PretrainConfig:
    model: ModelSpec
    data: PretrainData
    train: TrainConfig
    sample: SampleConfig
    # random: the book's fresh weights; else what continued pretraining starts from (pipeline/init_model.py):
    # a GPT-2 name (gpt2-small, ...: OpenAI's weights pinned in gpt2.weights), a model folder or a models:/ URI.
    init: str = "random"

    def __post_init__(self) -> None:
        require(
            bool(self.init.strip()), "init", "expected random, a GPT-2 name, a model folder or a models:/ URI"
        )
        require(
            not self.init.startswith(("models:/", "runs:/")) or bool(INIT_MODEL_URI.fullmatch(self.init)),
            "init",
            f"{self.init!r}: name a registered version by its number (models:/NAME/VERSION) or a model id "
            "(models:/m-...): a version never changes, so params.yaml pins it for DVC; an alias may move",
        )
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
class Params:
    """The whole of params.yaml."""

    tracking: TrackingConfig
    checkpoints: CheckpointConfig
    data: DataConfig
    corpus: CorpusConfig
    tokenize: TokenizeConfig
    pretrain: PretrainConfig
    eval: EvalConfig
    gpt2: Gpt2Config
    spam: SpamConfig
    instruct: InstructConfig
    preference: PreferenceConfig
    # The training stages' processes; a params file written before it trains in one, as ever.
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self) -> None:
        # What spam trains and reads must fit its base model, known here for GPT-2's presets and,
        # with gpt2.source pretrain, for this pipeline's own model.
        layers, context = self._base_model_size(self.spam.base_model)
        name = f"spam.base_model {self.spam.base_model}"
        check_trainable_blocks(self.spam.trainable_blocks, layers, name)
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
