"""What a live figure reads: the pinned input files of the run (The Verdict, GPT-2's BPE files)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import tiktoken


class NotRun(Exception):
    """Our value is not available; the message says why (shown in the report)."""


class FigureInputs(Protocol):
    root: Path  # the project folder holding reports/
    params: dict[str, Any]  # the run's flattened params


def raw_dir(run: FigureInputs | None) -> Path:
    """The download stage's folder (data.raw_dir), else the mirror (GPTLAB_MIRROR)."""
    root, params = (run.root, run.params) if run is not None else (Path.cwd(), {})
    candidates = [root / str(params.get("data.raw_dir") or "data/raw")]
    if os.environ.get("GPTLAB_MIRROR"):
        candidates.append(Path(os.environ["GPTLAB_MIRROR"]))
    for folder in candidates:
        if (folder / "the-verdict.txt").is_file() and (folder / "gpt2" / "vocab.bpe").is_file():
            return folder
    raise NotRun(f"no input files in {candidates[0]} (run `dvc repro download` or set GPTLAB_MIRROR)")


def tokenizer(run: FigureInputs | None) -> tiktoken.Encoding:
    return tokenizer_of(raw_dir(run))


def verdict_text(run: FigureInputs | None) -> str:
    return (raw_dir(run) / "the-verdict.txt").read_text(encoding="utf-8")


@functools.cache
def tokenizer_of(folder: Path) -> tiktoken.Encoding:
    """GPT-2's BPE from a folder's files, loaded once."""
    # model.tokenizer (torch) on first use: keeps `gptlab --help` fast
    from gptlab.model.tokenizer import load_tokenizer

    return load_tokenizer(folder)
