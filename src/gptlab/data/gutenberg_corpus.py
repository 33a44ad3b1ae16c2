"""The Gutenberg books as one source of documents for corpus_shards: each book, its headers stripped.

Writes gutenberg/{train,val}-NNNNN.bin and books.json (each book's split, tokens and what
stripping removed), and returns the counts for reports/tokenize/counts.json.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from gptlab.data.corpus_shards import Document, Shards, staged_dir, tokenize_documents
from gptlab.data.gutenberg import Book, book_text, list_digest
from gptlab.errors import InputError
from gptlab.files import write_json

BOOKS_REPORT = "books.json"


def tokenize_books(
    books: Sequence[Book],
    books_dir: Path,
    out_dir: Path,
    tokenizer: tiktoken.Encoding,
    *,
    val_every: int,
    shard_tokens: int,
) -> dict[str, Any]:
    """`out_dir`/{train,val}-NNNNN.bin and books.json from the books in `books_dir`; returns the counts."""
    require_books(books, books_dir)
    records: list[dict[str, Any]] = []
    digest = list_digest(books)
    with staged_dir(out_dir) as tmp:
        shards = tokenize_documents(
            _documents(books, books_dir, records),
            len(books),
            tmp,
            tokenizer,
            val_every=val_every,
            shard_tokens=shard_tokens,
            total_bytes=sum(b.bytes for b in books),
        )
        write_json(tmp / BOOKS_REPORT, {"list_sha256": digest, "books": records}, sort_keys=False)
    return _counts(records, shards, digest)


def _documents(books: Sequence[Book], books_dir: Path, records: list[dict[str, Any]]) -> Iterator[Document]:
    """Each book read as it is tokenized, its record appended to `records`."""
    for book in books:
        text = book_text((books_dir / book.file).read_bytes(), book.file)
        record = {
            "file": book.file,
            "split": None,
            "tokens": 0,  # its `<|endoftext|>` included
            "bytes": book.bytes,
            "stripped_bytes": text.stripped_bytes,
            "markers": text.markers,
        }
        records.append(record)
        yield Document(text.text, book.bytes, record)


def require_books(books: Sequence[Book], books_dir: Path) -> None:
    """Each book present at its pinned size, checked before any work: a missing one is one line."""
    for book in books:
        path = books_dir / book.file
        size = path.stat().st_size if path.is_file() else None
        if size != book.bytes:
            found = "missing" if size is None else f"{size:,} bytes, expected {book.bytes:,}"
            raise InputError(f"{path}: {found}; run `dvc repro download` (or set GPTLAB_MIRROR)")


def _counts(records: list[dict[str, Any]], shards: Shards, digest: str) -> dict[str, Any]:
    """Books, tokens and shards per split, and what stripping removed, for reports/tokenize/counts.json."""
    return {
        "books": len(records),
        "tokens": sum(r["tokens"] for r in records),
        "bytes": sum(r["bytes"] for r in records),
        "bytes_stripped": sum(r["stripped_bytes"] for r in records),
        "books_without_markers": sum(r["markers"] != "both" for r in records),
        "list_sha256": digest,
    } | shards.counts("books")
