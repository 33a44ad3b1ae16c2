"""`gptlab mirror DIR`: every pinned input written into DIR, laid out for GPTLAB_MIRROR.

Run it on a machine with internet, carry DIR to an offline one and set
GPTLAB_MIRROR=DIR there: the download and load-gpt2 stages and the tests then
take every input from it (with a profile whose corpus is Gutenberg's, its books too).
Each file goes through the pipeline's own fetch
(already in DIR with the right hash -> GPTLAB_MIRROR -> its URL, or for weights
the Hugging Face hub client and its cache), verified by sha256 and renamed into
place only once complete.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from gptlab.experiments.profiles import profile_params, profile_path
from gptlab.pipeline.params import load_params

if TYPE_CHECKING:
    from gptlab.data.config import CorpusConfig
    from gptlab.data.inputs import PinnedInput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="the folder to write (created if missing)")
    parser.add_argument(
        "--params", type=Path, default=Path("params.yaml"), help="the pins to read (default: %(default)s)"
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="profiles/NAME.yaml (or a path) applied to the params first, e.g. gutenberg: its books too",
    )
    parser.add_argument(
        "--no-weights",
        action="store_true",
        help="only the data and tokenizer files (a few MB); skip OpenAI's GPT-2 weights (GBs)",
    )


def run(args: argparse.Namespace) -> int:
    # urllib, ssl and tqdm once the command runs: keeps `gptlab --help` fast
    from gptlab.data.fetch import MIRROR_ENV, FetchError, mirror_dir
    from gptlab.data.inputs import data_inputs, fetch_input, weights_inputs

    if args.profile is None:
        params = load_params(args.params)
    else:
        params = profile_params(profile_path(args.profile), args.params)
    pins = data_inputs(params.data.sources) + _book_inputs(params.corpus)
    weights = [] if args.no_weights else weights_inputs(params.gpt2.weights)
    source = mirror_dir()
    if source is not None and source.resolve() == args.dir.resolve():
        source = (
            None  # DIR is the mirror being refreshed: its own files are checked, not copied onto themselves
        )
    total = 0
    for pin in pins + weights:
        try:
            got = fetch_input(pin, args.dir, source)
        except FetchError as exc:
            if pin in weights:
                raise FetchError(f"{exc}\n--no-weights writes the data files only.") from exc
            raise
        total += got.size
        print(f"{pin.key}: {got.path} ({got.size:,} bytes, {got.origin})")
    print(f"{len(pins) + len(weights)} files verified in {args.dir} ({total:,} bytes).")
    print(f"On a machine without internet: export {MIRROR_ENV}={args.dir.resolve()}")
    return 0


def _book_inputs(corpus: CorpusConfig) -> list[PinnedInput]:
    """Every book the corpus takes, at corpus.gutenberg.path/<file>; none for The Verdict."""
    # once the command runs, as in `run`: keeps `gptlab --help` fast
    from gptlab.data.fetch import safe_relative_path
    from gptlab.data.gutenberg import corpus_books
    from gptlab.data.inputs import PinnedInput

    if corpus.name != "gutenberg":
        return []
    folder = safe_relative_path(corpus.gutenberg.path, "corpus.gutenberg.path")
    return [
        PinnedInput(
            f"corpus.gutenberg {book.file}", folder / book.file, book.url, book.sha256, size=book.bytes
        )
        for book in corpus_books(corpus.gutenberg)
    ]
