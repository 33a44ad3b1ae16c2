"""Stage `tokenize`: The Verdict, the SMS spam collection and the instruction data, ready to train on.

Reads the download stage's files from data.raw_dir (the labelled texts from
tokenize.spam.file: the collection, or your own CSV/TSV/JSONL file) and writes under
data.processed_dir: verdict/{train,val}.npy, spam/{train,val,test}.{csv,npy} (and
labels.json, your file's class names),
instruct/{train,val,test}.json and preference/{train,val,test}.json (the DPO
notebook's pairs, split as chapter 7; their sizes are the preference stage's to
report); with corpus.name gutenberg, also the books as token shards,
gutenberg/{train,val}-NNNNN.bin and books.json (corpus_shards.py).
Counts, lengths and class balance go to
reports/tokenize/counts.json (a plain report: counts are no metrics to compare)
and to the stage's MLflow run as `counts.*` params; the three raw datasets are
the run's inputs, with their DVC content hash and split sizes.

(Named tokenize_data.py, not tokenize.py: a script's folder goes first on the
import path, and a stages/tokenize.py would shadow the standard library's.)
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.data import instruct, preference, spam, verdict
from gptlab.data.config import SpamSplit
from gptlab.data.corpus_shards import BOOKS_REPORT, require_books, tokenize_books
from gptlab.data.gutenberg import corpus_books
from gptlab.files import write_json
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import REPORTS
from gptlab.pipeline.params import Params
from gptlab.schema import flatten
from gptlab.tracking.runs import stage_run

if TYPE_CHECKING:
    import pandas as pd

REPORT = REPORTS / "tokenize" / "counts.json"


def run(params: Params) -> None:
    cfg = params.tokenize
    processed_dir = Path(params.data.processed_dir)
    sources = params.data.sources
    inputs = {
        f.name: Path(params.data.raw_dir) / getattr(sources, f.name).path for f in dataclasses.fields(sources)
    }
    # Refuse before any work, so neither outputs nor a failed MLflow run are left behind.
    missing = [str(path) for path in inputs.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"missing input {', '.join(missing)}: run `dvc repro download` (or set GPTLAB_MIRROR)"
        )
    corpus = params.corpus.gutenberg
    books = corpus_books(corpus, params.data.raw_dir) if params.corpus.name == "gutenberg" else []
    books_dir = Path(params.data.raw_dir) / corpus.path
    require_books(books, books_dir)
    # The labelled texts read and checked before any work too: a bad row stops the stage here.
    own, labelled = _labelled_texts(cfg.spam)
    tokenizer = gpt2_tokenizer(inputs["gpt2_vocab_bpe"], inputs["gpt2_encoder_json"])
    logged = {
        "data.raw_dir": params.data.raw_dir,
        "data.processed_dir": params.data.processed_dir,
        **flatten(cfg, "tokenize"),
        **(flatten(params.corpus, "corpus") if books else {}),
    }
    with stage_run(
        "tokenize", params.tracking.experiment, logged, system_metrics=params.tracking.system_metrics
    ) as tracker:
        metrics: dict[str, Any] = {
            "verdict": verdict.prepare(
                inputs["the_verdict"], processed_dir, tokenizer, cfg.verdict.train_ratio
            ),
            "spam": spam.write_splits(*labelled, processed_dir, tokenizer, own=own is not None),
            "instruct": instruct.prepare(
                inputs["instruction_data"],
                processed_dir,
                tokenizer,
                train_frac=cfg.instruct.train_frac,
                test_frac=cfg.instruct.test_frac,
                max_records=cfg.instruct.max_records,
            ),
        }
        preference.prepare(
            inputs["instruction_preference"],
            processed_dir,
            train_frac=cfg.preference.train_frac,
            test_frac=cfg.preference.test_frac,
            max_records=cfg.preference.max_records,
        )
        if books:
            metrics["gutenberg"] = tokenize_books(
                books,
                books_dir,
                processed_dir / "gutenberg",
                tokenizer,
                val_every=corpus.val_every,
                shard_tokens=corpus.shard_tokens,
            )
            sizes = _split_sizes(metrics["gutenberg"])
            tracker.log_input("gutenberg", books_dir, context="source", profile=sizes)
            tracker.log_artifact(processed_dir / "gutenberg" / BOOKS_REPORT, "tokenize/gutenberg")
        write_json(REPORT, metrics)
        tracker.log_params(flatten(metrics, "counts"))
        sources = {
            "verdict": inputs["the_verdict"],
            "spam": Path(cfg.spam.file),
            "instruct": inputs["instruction_data"],
        }
        for name, source in sources.items():
            tracker.log_input(name, source, context="source", profile=_split_sizes(metrics[name]))
        tracker.log_artifact(REPORT, "tokenize")
        example = instruct.load_split(processed_dir, "train")[:1]
        if example:
            prompt = instruct.format_prompt(example[0]) + example[0]["output"]
            tracker.log_text(prompt, "tokenize/instruct_example.txt")
    print(json.dumps(metrics, indent=2, sort_keys=True))


def _labelled_texts(split: SpamSplit) -> tuple[spam.OwnFile | None, tuple[pd.DataFrame, spam.SpamSplits]]:
    """How tokenize.spam.file reads (None: the collection, as the book), and its checked splits."""
    own = None
    if split.format != "sms":
        own = spam.OwnFile(split.format, split.text_column, split.label_column, split.labels)
    labelled = spam.load_splits(
        split.file,
        seed=split.seed,
        train_frac=split.train_frac,
        val_frac=split.val_frac,
        max_rows=split.max_rows,
        balance=split.balance,
        own=own,
    )
    return own, labelled


def _split_sizes(counts: dict[str, Any]) -> dict[str, Any]:
    """Each split's size (rows, records or tokens) from a dataset's counts."""
    sizes = {}
    for split, value in counts.items():
        if isinstance(value, dict) and split in ("train", "val", "test"):
            unit = next(k for k in ("rows", "records", "tokens") if k in value)
            sizes[f"{split}_{unit}"] = value[unit]
    return sizes


if __name__ == "__main__":
    stage_main(run, __doc__)
