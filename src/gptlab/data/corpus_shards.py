"""The Gutenberg books tokenized as a stream into uint16 shards, in a memory budget fixed whatever their number.

Books are read one at a time, their headers stripped (gutenberg.book_text), cut into
pieces that encode to exactly the book's ids (pieces_of), encoded a batch of pieces at a
time on every core by tiktoken's batch encoding, each book ended with `<|endoftext|>`,
and appended to the train or val shards (token_shards.ShardWriter): memory is one book,
one batch and one shard per split, whatever the number or length of the books. Validation holds out whole books
(gutenberg.is_validation), so no book is split between the two.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tiktoken
from tqdm import tqdm

from gptlab.data.gutenberg import Book, book_text, is_validation, list_digest
from gptlab.data.token_shards import ShardWriter
from gptlab.errors import InputError
from gptlab.files import write_json

# Characters encoded per text: books are cut into pieces of about this size, so memory does not
# grow with a book's length and every core gets its share of each batch.
PIECE_CHARS = 1 << 16
# Characters encoded at once: the batch's text and token lists are most of the stage's own memory.
BATCH_CHARS = 2 << 20
SPLITS = ("train", "val")
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
    """`out_dir`/{train,val}-NNNNN.bin and books.json from the books in `books_dir`; returns the counts.

    Written beside `out_dir` and moved into place at the end, so a failure leaves the previous
    output (or none), never a mix of two runs' shards.
    """
    require_books(books, books_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writers = {split: ShardWriter(tmp, split, shard_tokens) for split in SPLITS}
    records: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], str, bool]] = []  # (its book's record, piece, the book's last)

    def encode_pending() -> None:
        encoded = tokenizer.encode_ordinary_batch([p for _, p, _ in pending], num_threads=os.cpu_count() or 1)
        for (record, _, last), ids in zip(pending, encoded, strict=True):
            ids.extend([tokenizer.eot_token] if last else [])
            writers[record["split"]].write(ids)
            record["tokens"] += len(ids)
        pending.clear()

    with tqdm(total=sum(b.bytes for b in books), unit="B", unit_scale=True, desc="tokenize") as bar:
        for index, book in enumerate(books):
            text = book_text((books_dir / book.file).read_bytes(), book.file)
            split = "val" if is_validation(index, len(books), val_every) else "train"
            record = {
                "file": book.file,
                "split": split,
                "tokens": 0,  # its `<|endoftext|>` included
                "bytes": book.bytes,
                "stripped_bytes": text.stripped_bytes,
                "markers": text.markers,
            }
            records.append(record)
            pieces = pieces_of(text.text, PIECE_CHARS)
            pending += [(record, piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
            if sum(len(piece) for _, piece, _ in pending) >= BATCH_CHARS:
                encode_pending()
            bar.update(book.bytes)
        encode_pending()
    shards = {split: writer.close() for split, writer in writers.items()}
    digest = list_digest(books)
    write_json(tmp / BOOKS_REPORT, {"list_sha256": digest, "books": records}, sort_keys=False)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return _counts(records, shards, digest)


def require_books(books: Sequence[Book], books_dir: Path) -> None:
    """Each book present at its pinned size, checked before any work: a missing one is one line."""
    for book in books:
        path = books_dir / book.file
        size = path.stat().st_size if path.is_file() else None
        if size != book.bytes:
            found = "missing" if size is None else f"{size:,} bytes, expected {book.bytes:,}"
            raise InputError(f"{path}: {found}; run `dvc repro download` (or set GPTLAB_MIRROR)")


def pieces_of(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each encoding to exactly its share of the ids.

    Cut only before a line break that follows a non-space character: GPT-2's pre-tokenizer
    always ends a word there and starts the whitespace run anew, so no token spans a cut.
    """
    pieces, begin = [], 0
    while len(text) - begin > size:
        cut = text.find("\n", begin + size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        pieces.append(text[begin:cut])
        begin = cut
    pieces.append(text[begin:])
    return pieces


def _counts(records: list[dict[str, Any]], shards: dict[str, list[Path]], digest: str) -> dict[str, Any]:
    """Books, tokens and shards per split, and what stripping removed, for reports/tokenize/counts.json."""
    counts: dict[str, Any] = {
        "books": len(records),
        "tokens": sum(r["tokens"] for r in records),
        "bytes": sum(r["bytes"] for r in records),
        "bytes_stripped": sum(r["stripped_bytes"] for r in records),
        "books_without_markers": sum(r["markers"] != "both" for r in records),
        "list_sha256": digest,
    }
    for split in SPLITS:
        taken = [r for r in records if r["split"] == split]
        counts[split] = {
            "books": len(taken),
            "tokens": sum(r["tokens"] for r in taken),
            "shards": len(shards[split]),
        }
    return counts
