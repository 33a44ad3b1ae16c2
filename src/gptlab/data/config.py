"""The data params: the pinned inputs (`data`), the corpus pretrain reads (`corpus`), the splits the tokenize stage makes, and OpenAI's weights."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field, fields
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
        check_shard_tokens(self.shard_tokens)


# Token ids per shard file a corpus may use. The floor is 64 windows of the longest context (1,024):
# below it a corpus becomes thousands of tiny files (one per token at 1: ~20 million for 171
# books); above the cap the writer's buffer alone takes 512 MiB (2 bytes an id).
SHARD_TOKENS_RANGE = (65_536, 1 << 28)


def check_shard_tokens(value: int, field: str = "shard_tokens") -> None:
    """A shard size any corpus section's `field` may hold (a FieldError naming it otherwise)."""
    low, high = SHARD_TOKENS_RANGE
    require(
        low <= value <= high,
        field,
        f"expected {low:,} to {high:,} token ids per shard file (64 windows of the longest context at "
        f"the least: fewer makes thousands of tiny files), got {value:,}",
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
        check_shard_tokens(self.shard_tokens)


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
    """The classifier's labelled texts: the SMS Spam Collection (format sms) or your own file, and its splits.

    `file` is a project path (a DVC dependency of tokenize); `labels` the class names in class-id
    order, or `sorted`; `balance` downsample cuts every class to the smallest one's count, as the
    book cuts ham to the spam count.
    """

    seed: int
    train_frac: float
    val_frac: float
    # Keep only this many rows of each split (smoke runs); null keeps all.
    max_rows: int | None
    file: str = "data/raw/sms_spam_collection/SMSSpamCollection"
    format: Literal["sms", "csv", "tsv", "jsonl"] = "sms"
    text_column: str = "text"
    label_column: str = "label"
    labels: list[str] | Literal["sorted"] = "sorted"
    balance: Literal["downsample", "none"] = "downsample"

    def __post_init__(self) -> None:
        _check_fractions(self.train_frac, self.val_frac, "val_frac", rest="test")
        require(
            self.max_rows is None or self.max_rows > 0,
            "max_rows",
            f"expected a positive integer or null, got {self.max_rows}",
        )
        if self.labels != "sorted":
            require(
                len(self.labels) >= 2 and len(set(self.labels)) == len(self.labels),
                "labels",
                f"expected at least 2 distinct class names (or sorted), got {self.labels}",
            )
        require(bool(self.file.strip()), "file", "expected a path to a labelled file, got an empty string")


@dataclass(frozen=True)
class InstructFields:
    """The file's own name for each field of the Alpaca layout (`input` may be absent from a record)."""

    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"


@dataclass(frozen=True)
class PreferenceFields(InstructFields):
    """As InstructFields, plus the two answers; `output` may be absent (the chosen answer stands in)."""

    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclass(frozen=True)
class InstructSplit:
    """Chapter 7's records and split. `path`: the book's file where download leaves it, or a file of your own.

    A file of your own is a JSON list or a JSONL file (`.jsonl`) of records in the Alpaca layout,
    named by `fields`, relative to the project (DVC tracks it as a dependency of tokenize).
    """

    train_frac: float
    test_frac: float
    max_records: int | None
    path: str = "data/raw/instruction-data.json"
    fields: InstructFields = field(default_factory=InstructFields)

    def __post_init__(self) -> None:
        _check_fractions(self.train_frac, self.test_frac, "test_frac", rest="validation")
        require(
            self.max_records is None or self.max_records > 0,
            "max_records",
            f"expected a positive integer or null, got {self.max_records}",
        )
        require(
            self.path.endswith((".json", ".jsonl")),
            "path",
            f"expected a .json or .jsonl file, got {self.path!r}",
        )
        require(
            not Path(self.path).is_absolute() and ".." not in Path(self.path).parts,
            "path",
            f"{self.path!r} is outside the project, where DVC cannot track it: copy the file under the "
            "project (data/own/, say) and give its relative path",
        )

    def is_book(self, raw_dir: str, source: SourceFile) -> bool:
        """Whether `path` is the book's file (`source`): where download leaves it, or as params.yaml spells it.

        The committed spelling stands for the book's file wherever data.raw_dir puts it (a
        stage run by hand on another raw_dir); DVC, whose dependency is `path` itself, needs
        `path` moved along with data.raw_dir.
        """
        default = next(f.default for f in fields(self) if f.name == "path")
        return self.path == default or Path(self.path) == Path(raw_dir) / source.path

    def records_path(self, raw_dir: str, source: SourceFile) -> Path:
        """The file to read: the book's under raw_dir, or the user's own."""
        return Path(raw_dir) / source.path if self.is_book(raw_dir, source) else Path(self.path)


@dataclass(frozen=True)
class PreferenceSplit(InstructSplit):
    path: str = "data/raw/instruction-data-with-preference.json"
    fields: PreferenceFields = field(default_factory=PreferenceFields)


@dataclass(frozen=True)
class TokenizeConfig:
    verdict: VerdictSplit
    spam: SpamSplit
    instruct: InstructSplit
    preference: PreferenceSplit


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
