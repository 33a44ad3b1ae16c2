"""The Gutenberg corpus: the committed book list, the books taken, their fetching, their text and their shards."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from gptlab.data.corpus_shards import is_validation, pieces_of
from gptlab.data.fetch import FetchError
from gptlab.data.gutenberg import (
    Book,
    book_text,
    corpus_books,
    list_digest,
    read_book_list,
    select_books,
)
from gptlab.data.gutenberg_corpus import tokenize_books
from gptlab.data.gutenberg_fetch import fetch_books
from gptlab.data.token_shards import read_shard, shard_paths
from gptlab.errors import InputError

from helpers import PROJECT_ROOT, cache_dir, committed_params

CORPUS = committed_params().corpus.gutenberg


def _books(*names: str) -> list[Book]:
    return [Book(name, 1, "0" * 64, f"https://example.org/{name}") for name in names]


def test_the_committed_list_pins_1775_books_and_two_per_author_are_the_171_mirrored() -> None:
    books = read_book_list(PROJECT_ROOT / CORPUS.books)
    assert len(books) == 1775
    assert len({book.file for book in books}) == 1775
    assert 811e6 < sum(book.bytes for book in books) < 812e6  # 811.8 MB
    assert len(select_books(books, books_per_author=2, max_books=None)) == 171


def test_books_per_author_applies_before_max_books() -> None:
    books = _books("a--1.txt", "a--2.txt", "a--3.txt", "b--1.txt", "c--1.txt")
    assert [b.file for b in select_books(books, 1, None)] == ["a--1.txt", "b--1.txt", "c--1.txt"]
    assert [b.file for b in select_books(books, 2, 3)] == ["a--1.txt", "a--2.txt", "b--1.txt"]
    assert select_books(books, None, None) == books


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("book.txt\t12\tnothex\thttps://x", "64 lowercase hex digits"),
        ("../book.txt\t12\t" + "0" * 64 + "\thttps://x", "stays inside its folder"),
        ("book.txt\t12", "expected 4 tab-separated fields"),
    ],
)
def test_a_malformed_row_of_the_list_is_named_by_its_line(tmp_path: Path, row: str, problem: str) -> None:
    path = tmp_path / "books.tsv"
    path.write_text("file\tbytes\tsha256\turl\n" + row + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=problem) as info:
        read_book_list(path)
    assert str(info.value).startswith(f"{path}, line 2")


def test_validation_takes_whole_books_every_nth_or_the_last() -> None:
    assert [i for i in range(45) if is_validation(i, 45, 20)] == [19, 39]
    assert [i for i in range(5) if is_validation(i, 5, 20)] == [4]
    assert [i for i in range(2) if is_validation(i, 2, 2)] == [1]


def test_the_list_digest_names_the_books_taken_and_their_order() -> None:
    books = _books("a--1.txt", "b--1.txt")
    assert list_digest(books) == list_digest(list(books))
    assert list_digest(books) != list_digest(books[::-1])
    assert list_digest(books) != list_digest(books[:1])


def test_book_text_keeps_what_lies_between_the_markers_with_lf_line_endings() -> None:
    raw = (
        b"Header line\r\nLicense\r\n***START OF THE PROJECT GUTENBERG EBOOK X***\r\n\r\n"
        b"Chapter 1\r\nIt was\rcold.\n\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nLicense\r\n"
    )
    text = book_text(raw, "x.txt")
    assert text.text == "Chapter 1\nIt was\ncold."
    assert text.markers == "both"
    normalised = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    assert text.stripped_bytes == len(normalised) - len(text.text.encode())


def test_book_text_without_markers_keeps_the_whole_file() -> None:
    text = book_text("*Project Gutenberg Etext*\r\n\r\nLe café\r\n".encode(), "y.txt")
    assert (text.text, text.markers, text.stripped_bytes) == (
        "*Project Gutenberg Etext*\n\nLe café",
        "none",
        1,
    )
    assert book_text(b"Text\n*** END OF IT\nLicense", "z.txt").text == "Text"


def test_book_text_that_is_not_utf8_is_named() -> None:
    with pytest.raises(InputError, match=r"^w\.txt: not UTF-8"):
        book_text(b"*** START OF IT\n\xff\xfe\n*** END OF IT\n", "w.txt")


def test_pieces_encode_to_exactly_the_whole_books_ids(gutenberg_books: list[Book], tokenizer) -> None:
    folder = cache_dir() / CORPUS.path
    for book in gutenberg_books[:2]:
        text = book_text((folder / book.file).read_bytes(), book.file).text
        pieces = pieces_of(text, 2000)
        assert len(pieces) > 50 and "".join(pieces) == text
        encoded = tokenizer.encode_ordinary_batch(pieces, num_threads=2)
        assert [i for ids in encoded for i in ids] == tokenizer.encode_ordinary(text)


def test_tokenize_writes_each_book_then_end_of_text_into_its_split(
    gutenberg_books: list[Book], tokenizer, tmp_path: Path
) -> None:
    folder = cache_dir() / CORPUS.path
    out = tmp_path / "gutenberg"
    counts = tokenize_books(gutenberg_books, folder, out, tokenizer, val_every=2, shard_tokens=50_000)

    books = json.loads((out / "books.json").read_text(encoding="utf-8"))
    assert books["list_sha256"] == counts["list_sha256"] == list_digest(gutenberg_books)
    assert [r["split"] for r in books["books"]] == ["train", "val", "train", "val"]
    assert [r["markers"] for r in books["books"]] == ["both", "both", "both", "none"]
    expected: dict[str, list[int]] = {"train": [], "val": []}
    for book, record in zip(gutenberg_books, books["books"], strict=True):
        text = book_text((folder / book.file).read_bytes(), book.file).text
        ids = [*tokenizer.encode_ordinary(text), tokenizer.eot_token]
        assert record["tokens"] == len(ids)
        expected[record["split"]] += ids
    for split, ids in expected.items():
        shards = shard_paths(out, split)
        assert all(len(read_shard(p)) == 50_000 for p in shards[:-1])
        assert np.concatenate([read_shard(p) for p in shards]).tolist() == ids
        assert counts[split] == {"books": 2, "tokens": len(ids), "shards": len(shards)}
    assert counts["books"] == 4 and counts["books_without_markers"] == 1
    assert counts["bytes_stripped"] == sum(r["stripped_bytes"] for r in books["books"]) > 0

    # A rerun on fewer books replaces the output whole: no shard of the first run is left.
    tokenize_books(gutenberg_books[:2], folder, out, tokenizer, val_every=2, shard_tokens=10**7)
    assert sorted(p.name for p in out.iterdir()) == ["books.json", "train-00000.bin", "val-00000.bin"]


def test_tokenize_refuses_a_missing_or_truncated_book_before_writing(
    gutenberg_books: list[Book], tokenizer, tmp_path: Path
) -> None:
    folder = tmp_path / "books"
    folder.mkdir()
    for book in gutenberg_books[:2]:
        shutil.copyfile(cache_dir() / CORPUS.path / book.file, folder / book.file)
    with pytest.raises(InputError, match=f"{gutenberg_books[2].file}: missing; run `dvc repro download`"):
        tokenize_books(
            gutenberg_books[:3], folder, tmp_path / "out", tokenizer, val_every=2, shard_tokens=100
        )
    os.truncate(folder / gutenberg_books[1].file, 100)
    with pytest.raises(InputError, match=f"{gutenberg_books[1].file}: 100 bytes, expected"):
        tokenize_books(
            gutenberg_books[:2], folder, tmp_path / "out", tokenizer, val_every=2, shard_tokens=100
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["books"]


def test_fetch_resumes_from_its_downloads_and_names_a_damaged_book(
    gutenberg_books: list[Book], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    mirror = tmp_path / "mirror"
    (mirror / CORPUS.path).mkdir(parents=True)
    for book in gutenberg_books[:3]:
        shutil.copyfile(cache_dir() / CORPUS.path / book.file, mirror / CORPUS.path / book.file)
    raw = tmp_path / "raw"
    assert fetch_books(gutenberg_books[:3], raw, CORPUS.path, mirror) == {"mirror": 3}
    assert sorted(p.name for p in (raw / CORPUS.path).iterdir()) == sorted(
        b.file for b in gutenberg_books[:3]
    )

    # DVC empties the stage's output before a rerun; the books already fetched stay, offline too.
    shutil.rmtree(raw)
    assert fetch_books(gutenberg_books[:3], raw, CORPUS.path, mirror_dir=None) == {"present": 3}

    # A damaged book, in the downloads and the mirror alike: one line names it, the others are kept.
    (mirror / CORPUS.path / gutenberg_books[3].file).write_text("not the book", encoding="utf-8")
    with pytest.raises(FetchError) as info:
        fetch_books(gutenberg_books, raw, CORPUS.path, mirror)
    first, named, hint = str(info.value).splitlines()
    assert first.startswith("1 of 4 books could not be fetched")
    assert (
        named.startswith(f"  {gutenberg_books[3].file}: mirror file ") and "does not match its pin" in named
    )
    assert hint.startswith(
        "Offline, set GPTLAB_MIRROR to a folder holding each book at gutenberg/books/<file>"
    )
    assert len(list((raw / CORPUS.path).iterdir())) == 3


def test_a_corpus_of_fewer_than_two_books_is_refused_naming_the_list(tmp_path: Path) -> None:
    path = tmp_path / "one.tsv"
    path.write_text(f"file\tbytes\tsha256\turl\na--1.txt\t1\t{'0' * 64}\thttps://x\n", encoding="utf-8")
    with pytest.raises(InputError, match=f"corpus.gutenberg: 1 book.s. taken from {path}; at least 2"):
        corpus_books(dataclasses.replace(CORPUS, books=str(path)))
    with pytest.raises(InputError, match="corpus.gutenberg.path '../books'"):
        corpus_books(dataclasses.replace(CORPUS, books=str(path), path="../books"))
