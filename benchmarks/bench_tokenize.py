"""Stage tokenize on the Gutenberg corpus: wall time and peak memory at 10 and at 171 books.

Each count runs the real stage script (stages/tokenize_data.py, so The Verdict, the spam
and the instruction data too, and its MLflow run) in a process of its own, with
corpus.name gutenberg, books_per_author 2 (the 171 books a mirror holds) and max_books
N, reading its inputs from a mirror folder (GPTLAB_MIRROR) and writing into a temporary
folder. The peak is that process's maximum resident set, as the kernel reports it to
its parent. A first run of the smallest count warms the page cache and is not counted;
the counts take turns, round after round, and each row is the median wall time.

With --files, the user's-files corpus too (corpus.name files) at each count of files: the
largest count of the books' text (headers stripped, as the books path trains on it) cut into
that many .txt files of about equal size at line breaks, and the first N of them for each
smaller N; its tokens/s compare with the books' at the largest count of books, the same text.

    python benchmarks/bench_tokenize.py                              # 10 and 171 books, 3 rounds
    python benchmarks/bench_tokenize.py --books 171 --files 10 1000  # and the files corpus
    python benchmarks/bench_tokenize.py --books 2 3 --rounds 1 --no-warmup   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def stage_params(tmp: Path, mirror: Path, books: int) -> Path:
    """params.yaml with the Gutenberg corpus's first `books` mirrored books, read from `mirror`."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    params["data"] |= {"raw_dir": str(mirror), "processed_dir": str(tmp / f"processed-{books}")}
    params["tokenize"]["spam"]["file"] = str(mirror / params["data"]["sources"]["sms_spam"]["path"])
    corpus = params["corpus"]
    corpus["name"] = "gutenberg"
    corpus["gutenberg"] |= {
        "books": str(ROOT / corpus["gutenberg"]["books"]),
        "books_per_author": 2,
        "max_books": books,
    }
    path = tmp / f"params-{books}.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return path


def files_params(tmp: Path, mirror: Path, books: int, files: list[int]) -> dict[int, Path]:
    """params.yaml for the files corpus at each count of `files`, cut from the first `books` books."""
    # only with --files: the books' own reader, from this checkout's package
    from gptlab.data.gutenberg import book_text, read_book_list, select_books

    listed = select_books(read_book_list(ROOT / "corpora" / "gutenberg.tsv"), 2, books)
    text = "".join(
        book_text((mirror / "gutenberg" / "books" / b.file).read_bytes(), b.file).text + "\n" for b in listed
    )
    size, begin, cut = len(text) // max(files), 0, []
    for index in range(max(files)):  # cut after a line break, so no word is split
        end = len(text) if index == max(files) - 1 else (text.find("\n", begin + size) + 1 or len(text))
        cut.append(text[begin:end])
        begin = end
    paths = {}
    for count in files:
        folder = tmp / f"texts-{count}"
        folder.mkdir()
        for index, piece in enumerate(cut[:count]):
            (folder / f"{index:05d}.txt").write_text(piece, encoding="utf-8")
        params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
        params["data"] |= {"raw_dir": str(mirror), "processed_dir": str(tmp / f"processed-files-{count}")}
        params["tokenize"]["spam"]["file"] = str(mirror / params["data"]["sources"]["sms_spam"]["path"])
        params["corpus"]["name"] = "files"
        params["corpus"]["files"]["path"] = folder.name  # the stage runs in tmp: inside its project
        paths[count] = tmp / f"params-files-{count}.yaml"
        paths[count].write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return paths


def run_stage(tmp: Path, params: Path) -> dict[str, Any]:
    """One run of the stage script: its wall seconds, peak resident MB and the corpus's counts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
    with (tmp / "stage.log").open("wb") as log:
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, str(ROOT / "stages" / "tokenize_data.py"), "--params", str(params)],
            cwd=tmp,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(
            f"the tokenize stage failed ({child.returncode}):\n{(tmp / 'stage.log').read_text()[-3000:]}"
        )
    counts = json.loads((tmp / "reports" / "tokenize" / "counts.json").read_text(encoding="utf-8"))
    corpus = "files" if "files" in counts else "gutenberg"
    return {"seconds": seconds, "peak_mb": usage.ru_maxrss / 1024, "counts": counts[corpus]}


def machine() -> str:
    """lscpu's model name and CPU count, the cores this process may use, and the load average."""
    fields = dict(
        line.split(":", 1)
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    )
    model, cpus = fields.get("Model name", "?").strip(), fields.get("CPU(s)", "?").strip()
    return f"{model}, {cpus} CPUs ({len(os.sched_getaffinity(0))} usable)"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--books", type=int, nargs="+", default=[10, 171], help="book counts (default: 10 171)"
    )
    parser.add_argument(
        "--files", type=int, nargs="*", default=[], help="file counts of the files corpus (e.g. 10 1000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each count (default: 3)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the uncounted first run")
    parser.add_argument(
        "--mirror",
        type=Path,
        default=os.environ.get("GPTLAB_MIRROR"),
        help="mirror folder holding the inputs and gutenberg/books/ (default: $GPTLAB_MIRROR)",
    )
    args = parser.parse_args()
    if args.mirror is None:
        parser.error("no mirror folder: pass --mirror DIR or set GPTLAB_MIRROR")
    print(f"machine: {machine()}; load average before: {load_average()}")
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-tokenize-") as name:
        tmp = Path(name)
        mirror = args.mirror.resolve()
        params = {("books", books): stage_params(tmp, mirror, books) for books in args.books}
        if args.files:
            made = files_params(tmp, mirror, max(args.books), args.files)
            params |= {("files", count): path for count, path in made.items()}
        if not args.no_warmup:
            run_stage(tmp, params[("books", min(args.books))])
        for _ in range(args.rounds):
            for key, path in params.items():
                runs.setdefault(key, []).append(run_stage(tmp, path))
    print(f"load average after: {load_average()}")
    rates = {
        kind: table(kind, {n: done for (k, n), done in runs.items() if k == kind})
        for kind in ("books", "files")
    }
    if args.files:
        print(
            f"tokens/s at {max(args.files)} files / at {max(args.books)} books: {rates['files'] / rates['books']:.3f}"
        )


def table(kind: str, runs: dict[int, list[dict[str, Any]]]) -> float:
    """One corpus's rows (median wall, peak RSS) and the peaks' ratio; returns tokens/s at its largest count."""
    if not runs:
        return 0.0
    print(f"{kind:>6} {'tokens':>12} {'wall s':>8} {'tokens/s':>10} {'peak MB':>8}")
    peaks, rate = {}, 0.0
    for count, done in sorted(runs.items()):
        seconds = statistics.median(r["seconds"] for r in done)
        peaks[count] = max(r["peak_mb"] for r in done)
        tokens = done[0]["counts"]["tokens"]
        rate = tokens / seconds
        print(f"{count:>6} {tokens:>12,} {seconds:>8.1f} {rate:>10,.0f} {peaks[count]:>8.0f}")
    smallest, largest = min(peaks), max(peaks)
    print(f"peak at {smallest} {kind} / peak at {largest}: {peaks[smallest] / peaks[largest]:.3f}")
    return rate


if __name__ == "__main__":
    main()
