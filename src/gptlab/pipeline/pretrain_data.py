"""What pretrain reads: The Verdict's two token arrays (chapter 5), or the corpus's token shards.

Either way the stage gets the windows it trains on, the windows its losses are scored on
(before, during and after training) and what its MLflow run records as the dataset.
The Verdict is small: its windows are in memory, and every one is scored, as the book.
A corpus is read through memory maps, and scored on a fixed sample of windows
(`pretrain.data.eval_windows`), spread evenly over each split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from gptlab.data.corpus_windows import ShardWindows, spread_sample
from gptlab.data.token_shards import shard_paths
from gptlab.data.verdict import SUBDIR, GPTDatasetV1, load_split, split_path
from gptlab.errors import InputError
from gptlab.pipeline.params import Params
from gptlab.training.losses import perplexity

SPLITS = ("train", "val")
# The tokenize stage's record of each corpus: the book list's sha256 and each book, or each file's.
RECORD_FILES = {"gutenberg": "books.json", "files": "documents.json"}


@dataclass(frozen=True)
class PretrainWindows:
    train: Dataset  # the windows training reads
    scored: dict[str, Dataset]  # per split, the windows its losses are scored on (the loop's val: "val")
    inputs: list[Path]  # the files whose content keys the resume folder
    # What MLflow records as the run's input: the corpus's name, folder and profile (split sizes;
    # a corpus's book count and list digest).
    name: str
    folder: Path
    profile: dict[str, int | str]


def pretrain_windows(params: Params, length: int | None = None) -> PretrainWindows:
    """The windows of `corpus.name` at pretrain.data's length and stride, or `length` for both (eval's)."""
    processed_dir = Path(params.data.processed_dir)
    cfg = params.pretrain.data
    max_length, stride = (cfg.max_length, cfg.stride) if length is None else (length, length)
    if params.corpus.name == "verdict":
        tokens = {split: load_split(processed_dir, split) for split in SPLITS}
        windows = {split: GPTDatasetV1(tokens[split], max_length, stride) for split in SPLITS}
        sizes = {f"{split}_tokens": len(ids) for split, ids in tokens.items()}
        folder, inputs = processed_dir / SUBDIR, [split_path(processed_dir, split) for split in SPLITS]
        described: dict[str, int | str] = {}
    else:
        folder = processed_dir / params.corpus.name
        shards = {split: shard_paths(folder, split) for split in SPLITS}
        windows = {split: ShardWindows(paths, max_length, stride) for split, paths in shards.items()}
        sizes = {f"{split}_tokens": sum(len(w) for w in windows[split].shards) for split in SPLITS}
        inputs = [folder]
        described = corpus_record(folder / RECORD_FILES[params.corpus.name])
    scored = {
        split: windows[split] if cfg.eval_windows is None else spread_sample(windows[split], cfg.eval_windows)
        for split in SPLITS
    }
    sizes |= {f"{split}_windows": len(data) for split, data in windows.items()}  # type: ignore[arg-type]
    return PretrainWindows(windows["train"], scored, inputs, params.corpus.name, folder, sizes | described)


def corpus_record(path: Path) -> dict[str, int | str]:
    """The corpus's size and digest: its book count and list sha256, or its file count and content sha256."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if "books" in record:
            return {"books": len(record["books"]), "list_sha256": record["list_sha256"]}
        return {"files": len(record["files"]), "content_sha256": record["content_sha256"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: unreadable corpus record ({exc}); rerun `dvc repro tokenize`") from None


def with_perplexity(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The evaluation rows with the validation perplexity beside the loss (corpus runs' losses.csv)."""
    return [row | {"val_perplexity": perplexity(row["val_loss"])} for row in history]
