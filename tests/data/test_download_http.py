"""Network, no mirror: the book list's pinned URLs downloaded over real HTTP by the pipeline's own fetch.

A local server answers for the pinned https URLs (GPTLAB_URL_REWRITE sends them to it), so the
bytes travel through urllib exactly as from the internet, and their sha256 is checked on arrival.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data.fetch import MIRROR_ENV, URL_REWRITE_ENV, FetchError, rewritten_url, sha256_file
from gptlab.data.gutenberg import Book, read_book_list
from gptlab.data.gutenberg_fetch import DOWNLOADS, fetch_books
from gptlab.pipeline.params import load_params
from stages import download

from helpers import PROJECT_ROOT, cache_dir, committed_params, committed_params_raw, serve_urls

BOOKS = committed_params().corpus.gutenberg


def _book_bytes(book: Book) -> bytes:
    return (cache_dir() / BOOKS.path / book.file).read_bytes()


def test_the_committed_list_pins_every_book_at_one_public_commit() -> None:
    books = read_book_list(PROJECT_ROOT / BOOKS.books)
    assert len(books) == 1775
    prefix = (
        "https://raw.githubusercontent.com/rcdm-uga/Gutenberg_Text/a0b16d35a9851168ce9ac649851c17b7ab08d48e/"
    )
    assert all(book.url.startswith(prefix) for book in books)
    assert len({book.file for book in books}) == len(books)


def test_books_download_over_http_from_their_pinned_urls(
    gutenberg_books: list[Book], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    files = {book.url: _book_bytes(book) for book in gutenberg_books}
    with serve_urls(files, tmp_path / "served") as served:
        monkeypatch.setenv(URL_REWRITE_ENV, served.rewrite)
        origins = fetch_books(gutenberg_books, Path("data/raw"), BOOKS.path, None)
    assert origins == {"url": len(gutenberg_books)}
    assert sorted(served.requested) == sorted(book.url.removeprefix("https:/") for book in gutenberg_books)
    for book in gutenberg_books:
        assert sha256_file(Path("data/raw") / BOOKS.path / book.file) == book.sha256


def test_a_damaged_byte_is_caught_by_its_sha256(
    gutenberg_books: list[Book], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    damaged, *good = gutenberg_books
    data = bytearray(_book_bytes(damaged))
    data[len(data) // 2] ^= 0x01  # one bit of one byte, same size
    files = {damaged.url: bytes(data)} | {book.url: _book_bytes(book) for book in good}
    with serve_urls(files, tmp_path / "served") as served, pytest.raises(FetchError) as caught:
        monkeypatch.setenv(URL_REWRITE_ENV, served.rewrite)
        fetch_books(gutenberg_books, Path("data/raw"), BOOKS.path, None)
    message = str(caught.value)
    assert message.startswith(f"1 of {len(gutenberg_books)} books could not be fetched")
    assert f"{damaged.file}: the download from {damaged.url} does not match its pin" in message
    books_dir = Path("data/raw") / BOOKS.path
    assert sorted(p.name for p in books_dir.iterdir()) == sorted(book.file for book in good)
    assert not (DOWNLOADS / BOOKS.path / damaged.file).exists()
    assert not [p for p in DOWNLOADS.rglob("*") if p.name.endswith(".part")]  # nothing half-written


def test_the_download_stage_fetches_every_input_over_http(
    shared_data: Path, gutenberg_books: list[Book], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The corpus's run with network and no mirror: every pinned URL, the zip's member and two books."""
    raw = committed_params_raw()
    raw["corpus"]["name"] = "gutenberg"
    raw["corpus"]["gutenberg"] |= {
        "books": str(PROJECT_ROOT / BOOKS.books),
        "books_per_author": 2,
        "max_books": 2,
    }
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    files = {book.url: _book_bytes(book) for book in gutenberg_books[:2]}
    for source in vars(committed_params().data.sources).values():
        data = (shared_data / source.path).read_bytes()
        if source.member is not None:  # the URL serves a zip holding the pinned file
            archive = io.BytesIO()
            with zipfile.ZipFile(archive, "w") as zf:
                zf.writestr(source.member, data)
            data = archive.getvalue()
        files[source.url] = data
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    monkeypatch.chdir(project)
    with serve_urls(files, tmp_path / "served") as served:
        monkeypatch.setenv(URL_REWRITE_ENV, served.rewrite)
        download.run(load_params("params.yaml"))
    assert len(served.requested) == len(files)
    for book in gutenberg_books[:2]:
        assert sha256_file(Path("data/raw") / BOOKS.path / book.file) == book.sha256
    for source in vars(committed_params().data.sources).values():
        assert sha256_file(Path("data/raw") / source.path) == source.sha256
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(raw["tracking"]["experiment"])
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id], "attributes.run_name = 'download'")
    origins = {k: v for k, v in run.data.tags.items() if k.startswith("origin.")}
    assert origins == {f"origin.{name}": "url" for name in vars(committed_params().data.sources)} | {
        "origin.gutenberg.url": "2"
    }


def test_url_rewrite_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "https://example.org/a%20b/c.txt"
    assert rewritten_url(url) == url  # no rule: the pinned URL itself
    monkeypatch.setenv(URL_REWRITE_ENV, "https://other.org/=x https://=http://127.0.0.1:8/")
    assert rewritten_url(url) == "http://127.0.0.1:8/example.org/a%20b/c.txt"
    monkeypatch.setenv(URL_REWRITE_ENV, "no-equals-sign")
    with pytest.raises(
        ValueError, match=f"{URL_REWRITE_ENV} rule 'no-equals-sign': expected PREFIX=REPLACEMENT"
    ):
        rewritten_url(url)
