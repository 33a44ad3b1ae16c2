"""The Gutenberg corpus: the committed book list, the books a run takes, and the text of each.

Each book is pinned like every other input (URL, sha256, size); gutenberg_fetch.py fetches them.
"""

from __future__ import annotations

import csv
import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gptlab.data.config import GutenbergCorpus
from gptlab.data.fetch import safe_relative_path
from gptlab.errors import InputError
from gptlab.schema import is_sha256

COLUMNS = ["file", "bytes", "sha256", "url"]
# Project Gutenberg's own lines around the book (the wording after "OF" varies).
START_MARKER = re.compile(rb"^\*\*\* *START OF.*$", re.MULTILINE)
END_MARKER = re.compile(rb"^\*\*\* *END OF.*$", re.MULTILINE)


@dataclass(frozen=True)
class Book:
    """One row of the book list: `author--title.txt`, its size, sha256 and pinned URL."""

    file: str
    bytes: int
    sha256: str
    url: str

    @property
    def author(self) -> str:
        return self.file.partition("--")[0]


@dataclass(frozen=True)
class BookText:
    """A book as it is trained on, and what was cut away around it."""

    text: str
    stripped_bytes: int  # Project Gutenberg's header and footer, in UTF-8 after line endings are LF
    markers: str  # which markers bounded the text: both, start, end or none (the whole file kept)


def read_book_list(path: Path) -> list[Book]:
    """The list's rows in order; a malformed row is one line naming the file and the line."""
    try:
        with Path(path).open(encoding="utf-8", newline="") as fh:
            reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, None)
            if header != COLUMNS:
                raise InputError(f"{path}: expected the tab-separated columns {COLUMNS}, got {header}")
            return [_book(row, f"{path}, line {line}") for line, row in enumerate(reader, start=2)]
    except FileNotFoundError:
        raise InputError(f"{path}: book list not found (corpus.gutenberg.books)") from None


def _book(row: list[str], where: str) -> Book:
    if len(row) != len(COLUMNS):
        raise InputError(f"{where}: expected {len(COLUMNS)} tab-separated fields, got {len(row)}")
    file, size, sha256, url = row
    safe_relative_path(file, f"{where}: book file")
    if not size.isdigit() or not is_sha256(sha256):
        raise InputError(
            f"{where}: expected a size in bytes and 64 lowercase hex digits, got {size!r}, {sha256!r}"
        )
    return Book(file, int(size), sha256, url)


def select_books(books: Iterable[Book], books_per_author: int | None, max_books: int | None) -> list[Book]:
    """The list's books in order, at most `books_per_author` of each author, then the first `max_books`."""
    taken: list[Book] = []
    per_author: Counter[str] = Counter()
    for book in books:
        if books_per_author is not None and per_author[book.author] >= books_per_author:
            continue
        per_author[book.author] += 1
        taken.append(book)
    return taken if max_books is None else taken[:max_books]


def corpus_books(cfg: GutenbergCorpus) -> list[Book]:
    """The books a run takes, per corpus.gutenberg; too few to split is one line naming the keys."""
    safe_relative_path(cfg.path, "corpus.gutenberg.path")
    books = select_books(read_book_list(Path(cfg.books)), cfg.books_per_author, cfg.max_books)
    if len(books) < 2:
        raise InputError(
            f"corpus.gutenberg: {len(books)} book(s) taken from {cfg.books}; "
            "at least 2 are needed (one to train on, one to validate on)"
        )
    return books


def list_digest(books: Iterable[Book]) -> str:
    """sha256 of the books taken (their rows, in order): names the corpus's exact content."""
    digest = hashlib.sha256()
    for book in books:
        digest.update(f"{book.file}\t{book.bytes}\t{book.sha256}\t{book.url}\n".encode())
    return digest.hexdigest()


def book_text(raw: bytes, file: str) -> BookText:
    """The book between Project Gutenberg's START and END lines, line endings made LF.

    A book without one of the markers keeps everything on that side (header or license
    included): the docs say so, and books.json records which markers each book had.
    Worked on bytes (the markers are ASCII), so only the book itself is decoded.
    """
    data = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    start = START_MARKER.search(data)
    end = END_MARKER.search(data, start.end() if start else 0)
    body = data[start.end() if start else 0 : end.start() if end else len(data)].strip()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{file}: not UTF-8 at byte {exc.start} of its text") from None
    markers = {(True, True): "both", (True, False): "start", (False, True): "end"}.get(
        (start is not None, end is not None), "none"
    )
    return BookText(text, len(data) - len(body), markers)
