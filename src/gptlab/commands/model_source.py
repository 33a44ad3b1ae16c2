"""`--model` of `gptlab classify` / `gptlab chat`: a checkpoint folder, or a model logged in MLflow.

A value starting with `models:/` (models:/gptlab-spam@champion, models:/gptlab-spam/3,
models:/<model_id>) or `runs:/` names a model in the tracking store (MLFLOW_TRACKING_URI,
else the project's mlflow.db): its artifacts are downloaded into a temporary folder and
the checkpoint and GPT-2's BPE files that the model carries are used from there.
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


@contextmanager
def model_source(value: str | None, default: Path) -> Iterator[ModelSource]:
    """Where the checkpoint is, for the time of the block (`default` when `--model` is not given)."""
    if value is None:
        yield ModelSource(default)
    elif not value.startswith(MODEL_URI_PREFIXES):
        yield ModelSource(Path(value))
    else:
        from gptlab.registry import downloaded_model  # imports mlflow: only for a model URI

        with downloaded_model(value) as (artifacts, defaults):
            bpe_files = (artifacts["vocab_bpe"], artifacts["encoder_json"])
            yield ModelSource(artifacts["checkpoint"], bpe_files, defaults)
