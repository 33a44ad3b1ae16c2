"""What each kind of gptlab model is logged as: the `PyfuncSpec` that `tracking.registry.log_model` logs.

Its signature and input example, its artifacts (the checkpoint folder and GPT-2's
BPE files), the gptlab package as its code, its pinned requirements, and its
models-from-code file, pyfunc_model_code.py, which MLflow runs when the model
loads: the pyfunc classes of pyfunc_models.py answer it. A training stage's
publishing imports this module, never pyfunc_models.py, so how a model is served
is part of no stage's code (dvc.yaml's deps): editing it reruns no training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

import gptlab
from gptlab.model.checkpoint import read_config
from gptlab.tracking.registry import CHECKPOINT, ENCODER_JSON, VOCAB_BPE, PyfuncSpec

KINDS = ("spam", "instruct", "lm")
# The kind each registered model is served as: the pretrained one generates text (lm).
SERVED_AS = {"pretrain": "lm", "spam": "spam", "instruct": "instruct", "preference": "instruct"}
# The key of a logged model's `model_config` that names its kind.
KIND_KEY = "gptlab.model_kind"
# What the gptlab modules a model runs import (pinned to the versions that logged it).
REQUIREMENTS = (
    "torch",
    "tiktoken",
    "safetensors",
    "numpy",
    "pandas",
    "scikit-learn",
    "tqdm",
    "pyyaml",
    "rouge-score",
)


def model_spec(
    kind: str,
    checkpoint: Path | str,
    bpe_files: tuple[Path, Path],
    defaults: Mapping[str, Any] | None = None,
) -> PyfuncSpec:
    """The pyfunc model of a registered model of `kind` (a MODEL_KINDS name), served as SERVED_AS says.

    `checkpoint` is its folder, `bpe_files` GPT-2's vocab.bpe and encoder.json; `defaults` the
    params' defaults (max_new_tokens, temperature, top_k, seed; spam: batch_size),
    e.g. the stage's own settings.
    """
    if kind not in SERVED_AS:
        raise ValueError(f"unknown model kind {kind!r}: expected one of {tuple(SERVED_AS)}")
    served = SERVED_AS[kind]
    defaults = defaults or {}
    vocab_bpe, encoder_json = bpe_files
    if served == "spam":
        inputs = Schema([ColSpec("string", "text")])
        labels = read_config(checkpoint)[1].get("labels", {})
        column = probability_column([labels[key] for key in sorted(labels, key=int)])
        outputs = Schema([ColSpec("string", "label"), ColSpec("double", column)])
        param_specs = [ParamSpec("batch_size", "long", int(defaults.get("batch_size", 8)))]
        example: Any = pd.DataFrame(
            {"text": ["You are a winner! Claim your free prize now", "Are we still on for dinner tonight?"]}
        )
    elif served == "instruct":
        inputs = Schema([ColSpec("string", "instruction"), ColSpec("string", "input", required=False)])
        outputs = Schema([ColSpec("string", "response")])
        param_specs = [
            ParamSpec("max_new_tokens", "long", int(defaults.get("max_new_tokens", 256))),
            *_sampling_params(defaults),
        ]
        # A short answer keeps the check MLflow runs on the example (when logging) quick.
        example = (
            pd.DataFrame(
                {"instruction": ["Rewrite the sentence using a simile."], "input": ["The car is very fast."]}
            ),
            {"max_new_tokens": 8},
        )
    else:
        inputs = Schema([ColSpec("string", "prompt")])
        outputs = Schema([ColSpec("string", "text")])
        param_specs = [
            ParamSpec("max_new_tokens", "long", int(defaults.get("max_new_tokens", 50))),
            *_sampling_params(defaults),
        ]
        example = (pd.DataFrame({"prompt": ["Every effort moves you"]}), {"max_new_tokens": 8})
    return PyfuncSpec(
        python_model=str(Path(__file__).with_name("pyfunc_model_code.py")),
        model_config={KIND_KEY: served},
        artifacts={CHECKPOINT: str(checkpoint), VOCAB_BPE: str(vocab_bpe), ENCODER_JSON: str(encoder_json)},
        code_paths=[str(Path(gptlab.__file__).parent)],
        signature=ModelSignature(inputs=inputs, outputs=outputs, params=ParamSchema(param_specs)),
        input_example=example,
        pip_requirements=requirements(),
    )


def probability_column(class_names: Sequence[str]) -> str:
    """The classifier's second answer: `spam_probability` (the book's ham and spam), else the
    `probability` of the label it answers."""
    return "spam_probability" if tuple(class_names) == ("ham", "spam") else "probability"


def _sampling_params(defaults: Mapping[str, Any]) -> list[ParamSpec]:
    """temperature (0: greedy), top_k (0: no limit) and seed, as the language and instruct models take them."""
    return [
        ParamSpec("temperature", "double", float(defaults.get("temperature", 0.0))),
        ParamSpec("top_k", "long", int(defaults.get("top_k") or 0)),
        ParamSpec("seed", "long", int(defaults.get("seed", 123))),
    ]


def requirements() -> list[str]:
    """The packages a logged model needs, at this environment's versions (no local build labels)."""
    pinned = []
    for name in REQUIREMENTS:
        try:
            version = package_metadata.version(name).split("+")[0]
        except package_metadata.PackageNotFoundError:
            pinned.append(name)
        else:
            pinned.append(f"{name}=={version}")
    return pinned
