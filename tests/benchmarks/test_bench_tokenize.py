"""benchmarks/bench_tokenize.py: the tokenize stage on the first Gutenberg books, its table read back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gptlab.data.gutenberg import Book, book_text
from gptlab.model.tokenizer import load_tokenizer

from helpers import PROJECT_ROOT, cache_dir, committed_params


@pytest.mark.slow
def test_bench_tokenize_runs_the_stage_and_reads_its_counts(
    shared_data: Path, gutenberg_books: list[Book]
) -> None:
    # The first three mirrored books are test books (two by Alcott, one by Alger); one stage run.
    # And the files corpus: those books' text cut into 3 files (the first 2 of them too).
    command = ["benchmarks/bench_tokenize.py", "--books", "3", "--files", "2", "3"]
    command += ["--rounds", "1", "--no-warmup"]
    result = subprocess.run(
        [sys.executable, *command, "--mirror", str(cache_dir())],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("machine: ") and "load average before: " in lines[0]
    header = lines.index(next(line for line in lines if line.split()[:2] == ["books", "tokens"]))
    books, tokens, seconds, _, peak_mb = lines[header + 1].split()
    assert books == "3" and int(tokens.replace(",", "")) == sum(_book_tokens(gutenberg_books[:3]))
    assert float(seconds) > 0 and float(peak_mb) > 0
    assert lines[header + 2] == "peak at 3 books / peak at 3: 1.000"
    assert lines[header + 3].split()[:2] == ["files", "tokens"]
    one, two = (lines[header + row].split() for row in (4, 5))
    assert (one[0], two[0]) == ("2", "3") and int(one[1].replace(",", "")) < int(two[1].replace(",", ""))
    # The same text as the books, no header: their tokens, give or take the cut and each file's end.
    assert abs(int(two[1].replace(",", "")) - int(tokens.replace(",", ""))) <= 8
    assert lines[header + 6].startswith("peak at 2 files / peak at 3: ")
    assert lines[header + 7].startswith("tokens/s at 3 files / at 3 books: ")


def _book_tokens(books: list[Book]) -> list[int]:
    """Each book's ids as the stage writes them: its text's, then `<|endoftext|>`."""
    tokenizer = load_tokenizer(cache_dir())
    folder = cache_dir() / committed_params().corpus.gutenberg.path
    return [
        len(tokenizer.encode_ordinary(book_text((folder / b.file).read_bytes(), b.file).text)) + 1
        for b in books
    ]
