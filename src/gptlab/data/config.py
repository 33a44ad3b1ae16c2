"""The data params: the pinned inputs (`data`), the corpus pretrain reads (`corpus`), the splits the tokenize stage makes, and OpenAI's weights."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptlab.schema import ConfigError, FieldError, is_sha256, require


@dataclass(frozen=True)
class SourceFile:
    """One external input, pinned by URL and sha256.

    `path` is where it lands under data.raw_dir and where it lies in a mirror
    folder; `member` names the file to take out of a zip download.
    """

    url: str
    sha256: str
    path: str
    member: str | None = None

    def __post_init__(self) -> None:
        if not is_sha256(self.sha256):
            raise ConfigError(f"sha256 {self.sha256!r} of {self.path}: expected 64 lowercase hex digits")


@dataclass(frozen=True)
class Sources:
    the_verdict: SourceFile
    sms_spam: SourceFile
    instruction_data: SourceFile
    instruction_preference: SourceFile
    gpt2_vocab_bpe: SourceFile
    gpt2_encoder_json: SourceFile


@dataclass(frozen=True)
class DataConfig:
    raw_dir: str
    processed_dir: str
    sources: Sources

    def bpe_files(self) -> tuple[Path, Path]:
        """GPT-2's vocab.bpe and encoder.json as the download stage leaves them."""
        raw = Path(self.raw_dir)
        return raw / self.sources.gpt2_vocab_bpe.path, raw / self.sources.gpt2_encoder_json.path


@dataclass(frozen=True)
class GutenbergCorpus:
    """Project Gutenberg books (the chapter 5 bonus), pinned one by one in a committed list.

    `books` is that list (a TSV of file, bytes, sha256, url); `path` is the books' folder under
    data.raw_dir and in a mirror folder. The books taken are the list's, in its order, at most
    `books_per_author` per author, then the first `max_books`; every `val_every`-th of them is
    held out for validation (the last one when fewer are taken).
    """

    books: str
    path: str
    books_per_author: int | None
    max_books: int | None
    val_every: int
    shard_tokens: int

    def __post_init__(self) -> None:
        require(
            self.books_per_author is None or self.books_per_author > 0,
            "books_per_author",
            f"expected a positive integer or null, got {self.books_per_author}",
        )
        # One book to train on and one to validate on, at the least.
        require(
            self.max_books is None or self.max_books >= 2,
            "max_books",
            f"expected an integer of at least 2 (one training and one validation book) or null, got {self.max_books}",
        )
        require(self.val_every >= 2, "val_every", f"expected an integer of at least 2, got {self.val_every}")
        require(
            self.shard_tokens > 0, "shard_tokens", f"expected a positive integer, got {self.shard_tokens}"
        )


@dataclass(frozen=True)
class FilesCorpus:
    """The user's own texts: every file under `path` (or those matching `glob` there).

    .txt and .md files are one document each; .jsonl, .jsonl.gz and .parquet files one per row,
    its `text_field`. `path` lies inside the project, so DVC tracks it as tokenize's dependency.
    Cleaning: line endings made LF (`normalize_newlines`), blank documents dropped (`drop_empty`),
    and those shorter than `min_chars` characters; every `val_every`-th document is held out.
    """

    path: str
    glob: str | None
    text_field: str
    encoding: str
    normalize_newlines: bool
    drop_empty: bool
    min_chars: int
    val_every: int
    shard_tokens: int

    def __post_init__(self) -> None:
        require(bool(self.text_field), "text_field", "expected the name of the field holding each text")
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise FieldError(
                "encoding", f"unknown encoding {self.encoding!r} (e.g. utf-8, latin-1, cp1252)"
            ) from None
        require(self.min_chars >= 0, "min_chars", f"expected 0 or a positive integer, got {self.min_chars}")
        require(self.val_every >= 2, "val_every", f"expected an integer of at least 2, got {self.val_every}")
        require(
            self.shard_tokens > 0, "shard_tokens", f"expected a positive integer, got {self.shard_tokens}"
        )


@dataclass(frozen=True)
class CorpusConfig:
    """What pretrain trains on: The Verdict (chapter 5, the default), the Gutenberg books or the user's files."""

    name: Literal["verdict", "gutenberg", "files"]
    gutenberg: GutenbergCorpus
    files: FilesCorpus


@dataclass(frozen=True)
class VerdictSplit:
    train_ratio: float

    def __post_init__(self) -> None:
        require(
            0 < self.train_ratio < 1, "train_ratio", f"expected a value in (0, 1), got {self.train_ratio}"
        )


@dataclass(frozen=True)
class SpamSplit:
    seed: int
    train_frac: float
    val_frac: float
    # Keep only this many rows of each split (smoke runs); null keeps all.
    max_rows: int | None

    def __post_init__(self) -> None:
        _check_fractions(self.train_frac, self.val_frac, "val_frac", rest="test")
        require(
            self.max_rows is None or self.max_rows > 0,
            "max_rows",
            f"expected a positive integer or null, got {self.max_rows}",
        )


@dataclass(frozen=True)
class InstructSplit:
    train_frac: float
    test_frac: float
    max_records: int | None

    def __post_init__(self) -> None:
        _check_fractions(self.train_frac, self.test_frac, "test_frac", rest="validation")
        require(
            self.max_records is None or self.max_records > 0,
            "max_records",
            f"expected a positive integer or null, got {self.max_records}",
        )


@dataclass(frozen=True)
class TokenizeConfig:
    verdict: VerdictSplit
    spam: SpamSplit
    instruct: InstructSplit
    preference: InstructSplit


@dataclass(frozen=True)
class HFWeights:
    """OpenAI's GPT-2 weights on the Hugging Face hub, pinned by revision and sha256."""

    repo_id: str
    revision: str
    filename: str
    sha256: str
    size: int | None

    def __post_init__(self) -> None:
        # Checked before a download of up to 1.5 GB starts, which could only end refused.
        require(is_sha256(self.sha256), "sha256", f"expected 64 lowercase hex digits, got {self.sha256!r}")
        require(
            self.size is None or self.size > 0,
            "size",
            f"expected a positive number of bytes or null, got {self.size}",
        )


def _check_fractions(train_frac: float, other_frac: float, other: str, *, rest: str) -> None:
    """Both fractions in (0, 1) and summing below 1, so the `rest` split (what is left) is not empty."""
    require(0 < train_frac < 1, "train_frac", f"expected a value in (0, 1), got {train_frac}")
    require(
        0 < other_frac < 1 - train_frac,
        other,
        f"expected a value in (0, {1 - train_frac:g}), so that train_frac + {other} stays below 1 "
        f"and the {rest} split is not empty, got {other_frac}",
    )
