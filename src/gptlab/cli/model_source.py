"""`--model` of `gptlab classify` / `gptlab chat`: a checkpoint folder, or a model logged in MLflow.

The value is resolved by gptlab.tracking.model_source (a `models:/` or `runs:/` URI is
downloaded from the tracking store), which the pretrain stage's `pretrain.init` shares.

`find_model` is what both commands call: the model, or a message saying how to get one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gptlab.errors import InputError
from gptlab.experiments.smoke import smoke_model_hint
from gptlab.pipeline.params import load_params
from gptlab.tracking.model_source import ModelSource, model_source


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
