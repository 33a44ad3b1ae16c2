"""`--model` of `gptlab classify` / `gptlab chat`: a checkpoint folder, or a model logged in MLflow.

A value starting with `models:/` (models:/gptlab-spam@champion, models:/gptlab-spam/3,
models:/<model_id>) or `runs:/` names a model in the tracking store (MLFLOW_TRACKING_URI,
else the project's mlflow.db): its artifacts are downloaded into a temporary folder and
the checkpoint and GPT-2's BPE files that the model carries are used from there.

`find_model` is what both commands call: the model, or a message saying how to get one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.errors import InputError
from gptlab.experiments.smoke import smoke_model_hint
from gptlab.pipeline.params import load_params

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
        # the MLflow side: only for a model URI, keeps `gptlab --help` fast
        from gptlab.tracking.registry import downloaded_model

        with downloaded_model(value) as (artifacts, defaults):
            bpe_files = (artifacts["vocab_bpe"], artifacts["encoder_json"])
            yield ModelSource(artifacts["checkpoint"], bpe_files, defaults)


@contextmanager
def find_model(
    value: str | None, default: Path, *, command: str, kind: str, stage: str
) -> Iterator[ModelSource]:
    """The trained model `--model` names (`default` without it), for the time of the block.

    Where there is no checkpoint, an InputError names the `stage` that writes one and, when
    `--model` was left out, the command line that uses the last `gptlab smoke` run's model.
    """
    from gptlab.model.checkpoint import CONFIG_FILE  # imports torch: only once the command runs

    with model_source(value, default) as source:
        if source.checkpoint.is_file():
            raise NotADirectoryError(
                f"--model {source.checkpoint}: is a file, not a checkpoint folder ({CONFIG_FILE} and its weights)"
            )
        if not (source.checkpoint / CONFIG_FILE).is_file():
            hint = "" if value is not None else smoke_model_hint(command, default, _raw_dir_default())
            raise InputError(
                f"no {kind} in {source.checkpoint}: run `dvc repro {stage}` first (or point --model at one){hint}"
            )
        yield source


def bpe_folder(raw_dir: Path | None) -> Path:
    """Where GPT-2's BPE files are read from: `--raw-dir`, else data.raw_dir of params.yaml once the
    download stage has filled it, else the mirror GPTLAB_MIRROR names (as the stages read inputs).

    tiktoken checks both files' sha256 wherever they come from.
    """
    from gptlab.data.fetch import mirror_dir  # on use: keeps `gptlab --help` fast

    if raw_dir is not None:
        return raw_dir
    default, mirror = _raw_dir_default(), mirror_dir()
    if mirror is not None and not (default / "gpt2" / "vocab.bpe").is_file():
        return mirror
    return default


def _raw_dir_default() -> Path:
    """data.raw_dir of the project's params.yaml (data/raw when it cannot be read)."""
    try:
        return Path(load_params().data.raw_dir)
    except Exception:  # noqa: BLE001 - only a hint: the default layout will do
        return Path("data/raw")
