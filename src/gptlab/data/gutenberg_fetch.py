"""The Gutenberg books fetched several at once, through the pipeline's pinned, mirror-aware fetch.

Downloads land first in `.gptlab/downloads/`, which DVC never clears (it empties a stage's
outputs before rerunning it), so an interrupted download resumes with the books it already
has; data.raw_dir then gets a hard link to each (a verified copy where links are refused).
A stop (Ctrl-C, SIGTERM) takes effect at once: no book starts after it, the downloads under way
are abandoned (their temporary files are removed by the next run), and data.raw_dir holds whole
books only.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator
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
    failures: dict[str, str] = {}
    stopped, linking = threading.Event(), threading.Lock()

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
        with linking:  # a stop waits for a link under way, and none starts after it
            if stopped.is_set():
                raise _Stopped
            _link(got.path, raw_dir / name, book)
        return got.origin

    with tqdm(total=len(books), unit="book", desc="books") as bar:
        try:
            for book, result in _fetched(books, fetch_one, stopped):
                if isinstance(result, FetchError):
                    first = str(result).splitlines()[0]  # "could not fetch <its download path>: <why>"
                    failures[book.file] = f"  {book.file}: {first.split(': ', 1)[-1]}"
                elif isinstance(result, BaseException):
                    raise result
                else:
                    origins[result] += 1
                bar.update()
        finally:  # done, failed or stopped: no book starts from here on
            with linking:
                stopped.set()
    if failures:
        listed = "\n".join(failures[book.file] for book in books if book.file in failures)  # list order
        raise FetchError(
            f"{len(failures)} of {len(books)} books could not be fetched (the others are kept; "
            "a rerun fetches only these):\n" + listed + f"\nOffline, set {MIRROR_ENV} to a "
            f"folder holding each book at {base}/<file> (`gptlab mirror DIR --profile NAME` writes one)."
        )
    return dict(origins)


class _Stopped(Exception):
    """A book fetched after the stop: not linked into data.raw_dir."""


def _fetched(
    books: list[Book], fetch_one: Callable[[Book], str], stopped: threading.Event
) -> Iterator[tuple[Book, str | BaseException]]:
    """(book, its origin or what it raised) as each is done, FETCH_WORKERS at a time.

    Daemon threads, not a ThreadPoolExecutor: Python joins an executor's threads at exit, so a
    stop would wait for every download under way (a stalled one for a minute). A worker takes no
    new book once `stopped` is set.
    """
    todo: queue.SimpleQueue[Book] = queue.SimpleQueue()
    done: queue.SimpleQueue[tuple[Book, str | BaseException]] = queue.SimpleQueue()
    for book in books:
        todo.put(book)

    def work() -> None:
        while not stopped.is_set():
            try:
                book = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((book, fetch_one(book)))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which decides
                done.put((book, exc))

    for _ in range(min(FETCH_WORKERS, len(books))):
        threading.Thread(target=work, name="fetch-book", daemon=True).start()
    for _ in books:
        yield done.get()


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
