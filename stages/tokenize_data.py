"""Stage `tokenize`: The Verdict, the SMS spam collection and the instruction data, ready to train on.

Reads the download stage's files from data.raw_dir and writes under
data.processed_dir: verdict/{train,val}.npy, spam/{train,val,test}.{csv,npy},
instruct/{train,val,test}.json and preference/{train,val,test}.json (the DPO
notebook's pairs, split as chapter 7; their sizes are the preference stage's to
report); with corpus.name gutenberg, also the books as token shards,
gutenberg/{train,val}-NNNNN.bin and books.json (gutenberg_corpus.py); with corpus.name
files, the user's own texts the same way, files/{train,val}-NNNNN.bin and documents.json
(files_corpus.py), every file checked before anything is written.
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
from typing import Any

from tiktoken import Encoding

from gptlab.data import instruct, preference, spam, verdict
from gptlab.data.files_corpus import DOCUMENTS_REPORT, FilesScan, scan_files, tokenize_files
from gptlab.data.gutenberg import Book, corpus_books
from gptlab.data.gutenberg_corpus import BOOKS_REPORT, require_books, tokenize_books
from gptlab.files import write_json
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import REPORTS
from gptlab.pipeline.params import Params
from gptlab.schema import flatten
from gptlab.tracking.buffered_run import StageRun
from gptlab.tracking.runs import stage_run

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
    books, own = _check_corpus(params)
    tokenizer = gpt2_tokenizer(inputs["gpt2_vocab_bpe"], inputs["gpt2_encoder_json"])
    logged = {
        "data.raw_dir": params.data.raw_dir,
        "data.processed_dir": params.data.processed_dir,
        **flatten(cfg, "tokenize"),
        **(flatten(params.corpus, "corpus") if books or own is not None else {}),
    }
    with stage_run(
        "tokenize", params.tracking.experiment, logged, system_metrics=params.tracking.system_metrics
    ) as tracker:
        metrics: dict[str, Any] = {
            "verdict": verdict.prepare(
                inputs["the_verdict"], processed_dir, tokenizer, cfg.verdict.train_ratio
            ),
            "spam": spam.prepare(
                inputs["sms_spam"],
                processed_dir,
                tokenizer,
                seed=cfg.spam.seed,
                train_frac=cfg.spam.train_frac,
                val_frac=cfg.spam.val_frac,
                max_rows=cfg.spam.max_rows,
            ),
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
        metrics |= _tokenize_corpus(params, books, own, tokenizer, tracker)
        write_json(REPORT, metrics)
        tracker.log_params(flatten(metrics, "counts"))
        for name in ("verdict", "spam", "instruct"):
            source = {"verdict": "the_verdict", "spam": "sms_spam", "instruct": "instruction_data"}[name]
            tracker.log_input(name, inputs[source], context="source", profile=_split_sizes(metrics[name]))
        tracker.log_artifact(REPORT, "tokenize")
        example = instruct.load_split(processed_dir, "train")[:1]
        if example:
            prompt = instruct.format_prompt(example[0]) + example[0]["output"]
            tracker.log_text(prompt, "tokenize/instruct_example.txt")
    print(json.dumps(metrics, indent=2, sort_keys=True))


def _check_corpus(params: Params) -> tuple[list[Book], FilesScan | None]:
    """The Gutenberg books present, or the user's files all read and checked: before any output."""
    books = corpus_books(params.corpus.gutenberg) if params.corpus.name == "gutenberg" else []
    require_books(books, Path(params.data.raw_dir) / params.corpus.gutenberg.path)
    return books, scan_files(params.corpus.files) if params.corpus.name == "files" else None


def _tokenize_corpus(
    params: Params, books: list[Book], own: FilesScan | None, tokenizer: Encoding, tracker: StageRun
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
    elif own is not None:
        source, record = Path(params.corpus.files.path), DOCUMENTS_REPORT
        counts = tokenize_files(own, processed_dir / "files", tokenizer)
    else:
        return {}
    name = params.corpus.name
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
