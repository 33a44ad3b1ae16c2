"""The Gutenberg books fetched several at once, through the pipeline's pinned, mirror-aware fetch.

Downloads land first in `.gptlab/downloads/`, which DVC never clears (it empties a stage's
outputs before rerunning it), so an interrupted download resumes with the books it already
has; data.raw_dir then gets a hard link to each (a verified copy where links are refused).
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from gptlab.data.fetch import MIRROR_ENV, FetchError, fetch, fetch_local, safe_relative_path
from gptlab.data.gutenberg import Book

# Where downloads wait for data.raw_dir, kept across DVC's clearing of the download stage's output.
DOWNLOADS = Path(".gptlab") / "downloads"
# Books fetched at once: network-bound, so more than the cores.
FETCH_WORKERS = 8


def fetch_books(books: list[Book], raw_dir: Path, folder: str, mirror_dir: Path | None) -> dict[str, int]:
    """Every book verified in `raw_dir`/`folder`, several at once under one progress bar; counts by origin.

    Mirrors hold the books in `folder` too. Books that cannot be had are reported together,
    one line each, once the others are fetched.
    """
    base = safe_relative_path(folder, "corpus.gutenberg.path")
    origins: Counter[str] = Counter()
    failures: list[str] = []

    def fetch_one(book: Book) -> str:
        name = base / safe_relative_path(book.file, "book file")
        mirror_file = mirror_dir / name if mirror_dir is not None else None
        got = fetch(
            DOWNLOADS / name,
            url=book.url,
            sha256=book.sha256,
            mirror_file=mirror_file,
            size=book.bytes,
            progress=False,
        )
        _link(got.path, raw_dir / name, book)
        return got.origin

    with ThreadPoolExecutor(FETCH_WORKERS) as pool, tqdm(total=len(books), unit="book", desc="books") as bar:
        futures = {book.file: pool.submit(fetch_one, book) for book in books}
        for file, future in futures.items():
            try:
                origins[future.result()] += 1
            except FetchError as exc:
                first = str(exc).splitlines()[0]  # "could not fetch <its download path>: <why>"
                failures.append(f"  {file}: {first.split(': ', 1)[-1]}")
            bar.update()
    if failures:
        raise FetchError(
            f"{len(failures)} of {len(books)} books could not be fetched (the others are kept; "
            "a rerun fetches only these):\n" + "\n".join(failures) + f"\nOffline, set {MIRROR_ENV} to a "
            f"folder holding each book at {base}/<file> (`gptlab mirror DIR --profile NAME` writes one)."
        )
    return dict(origins)


def _link(downloaded: Path, dest: Path, book: Book) -> None:
    """`dest` as a hard link to the verified download (a verified copy where links are refused)."""
    present = fetch_local(dest, url=book.url, sha256=book.sha256, size=book.bytes)
    if present is not None:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(downloaded, tmp)
    except OSError:
        fetch_local(dest, url=book.url, sha256=book.sha256, mirror_file=downloaded, size=book.bytes)
        return
    os.replace(tmp, dest)
