"""A model named by a folder or by a model logged in MLflow: where its checkpoint lies, for a block.

A value starting with `models:/` (models:/gptlab-spam@champion, models:/gptlab-spam/3,
models:/<model_id>) or `runs:/` names a model in the tracking store (MLFLOW_TRACKING_URI,
else the project's mlflow.db): its artifacts are downloaded into a temporary folder and
the checkpoint and GPT-2's BPE files that the model carries are used from there. Any
other value is a checkpoint folder. `gptlab classify` / `gptlab chat` (--model) and the
pretrain stage (pretrain.init) read their models through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_URI_PREFIXES = ("models:/", "runs:/")


@dataclass(frozen=True)
class ModelSource:
    checkpoint: Path
    # The model's own vocab.bpe and encoder.json; None for a plain folder (the project's are used).
    bpe_files: tuple[Path, Path] | None = None
    # The defaults of the logged model's params (e.g. max_new_tokens); empty for a folder.
    defaults: dict[str, Any] = field(default_factory=dict)


def is_model_uri(value: str) -> bool:
    """Whether `value` names a model in the tracking store rather than a folder."""
    return value.startswith(MODEL_URI_PREFIXES)


@contextmanager
def model_source(value: str | None, default: Path) -> Iterator[ModelSource]:
    """Where the checkpoint is, for the time of the block (`default` when no value is given)."""
    if value is None:
        yield ModelSource(default)
    elif not is_model_uri(value):
        yield ModelSource(Path(value))
    else:
        # the MLflow side: only for a model URI, keeps `gptlab --help` fast
        from gptlab.tracking.registry import downloaded_model

        with downloaded_model(value) as (artifacts, defaults):
            bpe_files = (artifacts["vocab_bpe"], artifacts["encoder_json"])
            yield ModelSource(artifacts["checkpoint"], bpe_files, defaults)
