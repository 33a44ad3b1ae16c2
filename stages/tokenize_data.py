"""Stage `tokenize`: The Verdict, the SMS spam collection and the instruction data, ready to train on.

Reads the download stage's files from data.raw_dir (the labelled texts from
tokenize.spam.file: the collection, or your own CSV/TSV/JSONL file) and writes under
data.processed_dir: verdict/{train,val}.npy, spam/{train,val,test}.{csv,npy} (and
labels.json, your file's class names),
instruct/{train,val,test}.json and preference/{train,val,test}.json (the DPO
notebook's pairs, split as chapter 7; their sizes are the preference stage's to
report); with corpus.name gutenberg, also the books as token shards,
gutenberg/{train,val}-NNNNN.bin and books.json (gutenberg_corpus.py); with corpus.name
files, the user's own texts the same way, files/{train,val}-NNNNN.bin and documents.json
(files_corpus.py), every file checked before anything is written.
The labelled texts, instructions and pairs may be files of the user's own
(tokenize.spam.file, tokenize.instruct.path, tokenize.preference.path): read and
checked before anything is written, the degenerate pairs dropped and named.
Counts, lengths and class balance go to
reports/tokenize/counts.json (a plain report: counts are no metrics to compare)
and to the stage's MLflow run as `counts.*` params; the raw datasets are
the run's inputs, with their DVC content hash and split sizes (the user's own
ones also the pipeline run's, tracking.buffered_run.StageRun.log_own_data).

(Named tokenize_data.py, not tokenize.py: a script's folder goes first on the
import path, and a stages/tokenize.py would shadow the standard library's.)
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiktoken import Encoding

from gptlab.data import instruct, preference, spam, verdict
from gptlab.data.config import SpamSplit
from gptlab.data.files_corpus import DOCUMENTS_REPORT, FilesScan, scan_files, tokenize_files
from gptlab.data.gutenberg import Book, corpus_books
from gptlab.data.gutenberg_corpus import BOOKS_REPORT, require_books, tokenize_books
from gptlab.files import project_folder, write_json
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import REPORTS
from gptlab.pipeline.params import Params
from gptlab.schema import flatten
from gptlab.tracking.buffered_run import StageRun
from gptlab.tracking.runs import stage_run

if TYPE_CHECKING:
    import pandas as pd

REPORT = REPORTS / "tokenize" / "counts.json"


def run(params: Params) -> None:
    cfg = params.tokenize
    processed_dir = project_folder(params.data.processed_dir, "data.processed_dir")
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
    own = _own_files(params)
    books, texts = _check_corpus(params)
    # The labelled texts read and checked before any work too: a bad row stops the stage here.
    labelled = _labelled_texts(cfg.spam)
    tokenizer = gpt2_tokenizer(inputs["gpt2_vocab_bpe"], inputs["gpt2_encoder_json"])
    raw_dir = params.data.raw_dir
    instructions = instruct.read_splits(
        cfg.instruct, cfg.instruct.records_path(raw_dir, sources.instruction_data)
    )
    pairs_path = cfg.preference.records_path(raw_dir, sources.instruction_preference)
    pairs = preference.read_splits(cfg.preference, pairs_path, tokenizer, book="preference" not in own)
    logged = {
        "data.raw_dir": params.data.raw_dir,
        "data.processed_dir": params.data.processed_dir,
        **flatten(cfg, "tokenize"),
        **(flatten(params.corpus, "corpus") if books or texts is not None else {}),
    }
    with stage_run(
        "tokenize", params.tracking.experiment, logged, system_metrics=params.tracking.system_metrics
    ) as tracker:
        metrics: dict[str, Any] = {
            "verdict": verdict.prepare(
                inputs["the_verdict"], processed_dir, tokenizer, cfg.verdict.train_ratio
            ),
            "spam": spam.write_splits(*labelled, processed_dir, tokenizer, own="spam" in own),
            "instruct": instruct.write_splits(instructions, processed_dir, tokenizer),
        }
        metrics.update(_write_pairs(pairs, pairs_path, processed_dir, own="preference" in own))
        metrics |= _tokenize_corpus(params, books, texts, tokenizer, tracker)
        write_json(REPORT, metrics)
        tracker.log_params(flatten(metrics, "counts"))
        for name in ("verdict", "spam", "instruct"):
            source = {"verdict": "the_verdict", "spam": "sms_spam", "instruct": "instruction_data"}[name]
            if name not in own:
                tracker.log_input(name, inputs[source], context="source", profile=_split_sizes(metrics[name]))
        for name, path in own.items():
            tracker.log_own_data(name, path, profile=_split_sizes(metrics[name]))
        tracker.log_artifact(REPORT, "tokenize")
        example = instruct.load_split(processed_dir, "train")[:1]
        if example:
            prompt = instruct.format_prompt(example[0]) + example[0]["output"]
            tracker.log_text(prompt, "tokenize/instruct_example.txt")
    print(json.dumps(metrics, indent=2, sort_keys=True))


def _own_files(params: Params) -> dict[str, Path]:
    """The labelled texts, instructions and pairs read from files of the user's own (not the book's)."""
    cfg, sources = params.tokenize, params.data.sources
    own = {
        name: Path(split.path)
        for name, split, source in (
            ("instruct", cfg.instruct, sources.instruction_data),
            ("preference", cfg.preference, sources.instruction_preference),
        )
        if not split.is_book(params.data.raw_dir, source)
    }
    for name, path in own.items():
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenize.{name}.path: {path} not found (a file of your own, in the project)"
            )
    if cfg.spam.format != "sms":  # the labelled file: read, and a missing one named, by spam.load_splits
        own["spam"] = Path(cfg.spam.file)
    return own


def _write_pairs(pairs: preference.Pairs, path: Path, processed_dir: Path, *, own: bool) -> dict[str, Any]:
    """Write the preference splits, naming the pairs dropped; their counts where the book's run had none.

    The book's pairs are the preference stage's to count, as they always were, unless some were dropped.
    """
    counts = preference.write_splits(pairs, processed_dir)
    if (dropped := preference.describe_dropped(pairs, path)) is not None:
        print(f"warning: {dropped}", file=sys.stderr)
    return {"preference": counts} if own or pairs.dropped else {}


def _labelled_texts(split: SpamSplit) -> tuple[pd.DataFrame, spam.SpamSplits]:
    """tokenize.spam.file's checked splits, read as the book reads the collection or as a file of your own."""
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
    return labelled


def _check_corpus(params: Params) -> tuple[list[Book], FilesScan | None]:
    """The Gutenberg books present, or the user's files all read and checked: before any output."""
    books = corpus_books(params.corpus.gutenberg) if params.corpus.name == "gutenberg" else []
    require_books(books, Path(params.data.raw_dir) / params.corpus.gutenberg.path)
    return books, scan_files(params.corpus.files) if params.corpus.name == "files" else None


def _tokenize_corpus(
    params: Params, books: list[Book], texts: FilesScan | None, tokenizer: Encoding, tracker: StageRun
) -> dict[str, Any]:
    """The corpus's token shards and record, as its counts.json entry; the run logs its input."""
    processed_dir = Path(params.data.processed_dir)
    if books:
        corpus = params.corpus.gutenberg
        source, record = Path(params.data.raw_dir) / corpus.path, BOOKS_REPORT
        counts = tokenize_books(
            books,
            source,
            processed_dir / "gutenberg",
            tokenizer,
            val_every=corpus.val_every,
            shard_tokens=corpus.shard_tokens,
        )
    elif texts is not None:
        source, record = Path(params.corpus.files.path), DOCUMENTS_REPORT
        counts = tokenize_files(texts, processed_dir / "files", tokenizer)
    else:
        return {}
    name = params.corpus.name
    if texts is not None:  # the user's own: the pipeline run names it too
        tracker.log_own_data(name, source, profile=_split_sizes(counts))
    else:
        tracker.log_input(name, source, context="source", profile=_split_sizes(counts))
    tracker.log_artifact(processed_dir / name / record, f"tokenize/{name}")
    return {name: counts}


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
