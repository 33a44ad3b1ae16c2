"""A stopped Gutenberg download (issue 65, row 70): no queued book starts, and data/raw holds whole books only.

The books come from a local HTTP server (a minimal one, here) that answers the first few at once and
holds every later request until the test ends, as a stalled network would: the stage must stop
without waiting for them.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gptlab.data.gutenberg import COLUMNS
from gptlab.data.gutenberg_fetch import FETCH_WORKERS
from gptlab.pipeline.params import load_params
from stages import download

from helpers import PROJECT_ROOT, committed_params_raw, sigint_as_in_a_terminal

BOOKS, ANSWERED = 40, 4  # books in the list; requests the server answers before it stalls
LIST_PATH, BOOKS_PATH = "gutenberg/stop-test.tsv", "gutenberg/books"


class _Books:
    """What the server serves and holds: each book by URL path, the requests seen, the gate."""

    def __init__(self) -> None:
        self.files = {f"/{i:02d}": f"book {i}\n".encode() * 2000 for i in range(BOOKS)}
        self.requests: Counter[str] = Counter()
        self.held = 0
        self.gate = threading.Event()  # set: every request is answered
        self.lock = threading.Lock()


def _handler(books: _Books) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with books.lock:
                books.requests[self.path] += 1
                stall = sum(books.requests.values()) > ANSWERED and not books.gate.is_set()
                books.held += stall
            if stall:
                books.gate.wait()
            body = books.files[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

    return Handler


@pytest.fixture
def book_server() -> Iterator[tuple[str, _Books]]:
    books = _Books()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(books))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", books
    finally:
        books.gate.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def _project(tmp_path: Path, base_url: str, books: _Books) -> Path:
    """A project whose corpus is the served books, listed in its own book list."""
    rows = ["\t".join(COLUMNS)]
    for path, body in books.files.items():
        name = f"stop-test-author-{path[1:]}--a-book.txt"
        rows.append(f"{name}\t{len(body)}\t{hashlib.sha256(body).hexdigest()}\t{base_url}{path}")
    listing = ("\n".join(rows) + "\n").encode()
    project = tmp_path / "project"
    (project / LIST_PATH).parent.mkdir(parents=True)
    (project / LIST_PATH).write_bytes(listing)
    params = committed_params_raw()
    gutenberg = params["corpus"]["gutenberg"]
    params["corpus"]["name"] = "gutenberg"
    gutenberg["books"] = LIST_PATH
    gutenberg.update(path=BOOKS_PATH, books_per_author=None, max_books=None)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return project


def _wait_for(condition, what: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the download stage never got to {what} (exit code {proc.poll()})")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_download_starts_no_queued_book_and_leaves_whole_books(
    shared_data: Path,
    book_server: tuple[str, _Books],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    signum: signal.Signals,
) -> None:
    base_url, books = book_server
    project = _project(tmp_path, base_url, books)
    folder = project / "data" / "raw" / BOOKS_PATH
    log = (tmp_path / "stderr.txt").open("w+", encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-P", str(PROJECT_ROOT / "stages" / "download.py"), "--params", "params.yaml"],
        cwd=project,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=os.environ,
        preexec_fn=sigint_as_in_a_terminal,  # noqa: PLW1509 - one signal.signal call after the fork
    )
    _wait_for(lambda: folder.is_dir() and len(list(folder.iterdir())) == ANSWERED, "its first books", proc)
    _wait_for(lambda: books.held > 0, "a stalled book", proc)
    proc.send_signal(signum)
    try:  # the stalled books are never answered: a stop that waits for them never comes
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{signum.name}: still running 60 s later, waiting for the books under way or queued")
    log.seek(0)
    said = log.read().strip().splitlines()
    assert code == 128 + signum, said
    assert said[-1].startswith(f"stopped by {signum.name}"), said
    # Whole, verified books only, and no temporary file beside them; no queued book was asked for.
    kept = sorted(p.name for p in folder.iterdir())
    assert len(kept) == ANSWERED, kept
    for name in kept:
        body = books.files["/" + name.split("--")[0].rsplit("-", 1)[1]]
        assert (folder / name).read_bytes() == body
    assert sum(books.requests.values()) <= ANSWERED + FETCH_WORKERS

    # Nothing lost: the rerun fetches the others only, and cleans what the stop abandoned.
    books.gate.set()
    before = Counter(books.requests)
    monkeypatch.chdir(project)
    download.run(load_params("params.yaml"))
    assert len(list(folder.iterdir())) == BOOKS
    asked = books.requests - before
    assert not set(asked) & {f"/{name.split('--')[0].rsplit('-', 1)[1]}" for name in kept}
    assert not [p for p in (project / ".gptlab" / "downloads").rglob("*") if p.name.endswith(".part")]
