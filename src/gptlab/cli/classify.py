"""`gptlab classify`: label SMS-like messages as spam or ham with the fine-tuned classifier.

Messages come as arguments, or one per line from `--file PATH` (`-` for stdin).
Each is encoded, truncated and padded to the checkpoint's training length as
in the spam-finetune stage, then printed as `label<TAB>probability<TAB>text`,
the text on one line, cut after 200 characters, its control characters escaped
(or one JSON object per line, whole, with `--json`). `--file` reads at most
64 MiB, so an endless stream stops.

`--model` takes a checkpoint folder or a model logged in MLflow
(`models:/gptlab-spam@champion`), whose own BPE files are then used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import IO, Any

from gptlab.cli.inference_options import add_inference_arguments, load_for_inference
from gptlab.cli.model_source import ModelSource, bpe_folder, find_model
from gptlab.errors import InputError
from gptlab.files import require_folder
from gptlab.paths import SPAM_MODEL
from gptlab.schema import is_control
from gptlab.tasks import request

# The heavy imports (torch, the model) happen once the command runs, so `gptlab --help` stays fast.

MAX_INPUT_BYTES = 64 << 20  # what --file reads at most: some 400,000 SMS-sized messages
SHOWN_CHARS = 200  # of each message, in the plain output (--json gives it whole)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="messages to classify")
    parser.add_argument(
        "--file",
        metavar="PATH",
        help="read one message per line from PATH ('-' for stdin); blank lines are skipped",
    )
    parser.add_argument(
        "--model",
        metavar="DIR|URI",
        help="classifier checkpoint folder (default: the output of `dvc repro spam-finetune`, models/spam), "
        "or a model logged in MLflow, e.g. models:/gptlab-spam@champion or models:/gptlab-spam/3",
    )
    parser.add_argument(
        "--raw-dir",
        type=Path,
        metavar="DIR",
        help="folder holding gpt2/vocab.bpe and gpt2/encoder.json (default: the MLflow model's own, "
        "else data.raw_dir of params.yaml, else $GPTLAB_MIRROR)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="messages per forward pass (default: 8)")
    add_inference_arguments(parser)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per message: label, probability, text"
    )


def run(args: argparse.Namespace) -> int:
    # The arguments and messages first, before the model and torch load (seconds): one line at once.
    batch_size = request.batch_size(args.batch_size, "--batch-size")
    texts = request.texts(
        _read_texts(args.texts, args.file), "message {n}", hint="give some text to classify"
    )
    if args.raw_dir is not None:
        require_folder(args.raw_dir, "--raw-dir")
    with find_model(
        args.model, SPAM_MODEL, command="classify", kind="trained classifier", stage="spam-finetune"
    ) as source:
        return _classify(args, source, texts, batch_size)


def _classify(args: argparse.Namespace, source: ModelSource, texts: list[str], batch_size: int) -> int:
    # torch on first use: keeps `gptlab --help` fast
    from gptlab.model.tokenizer import gpt2_tokenizer, load_tokenizer
    from gptlab.tasks.classifier import classify_texts

    model_dir = source.checkpoint
    model, metadata = load_for_inference(model_dir, args)
    missing = [key for key in ("labels", "max_length", "pooling") if key not in metadata]
    shown = args.model or model_dir
    if model.cfg.is_language_model or missing:
        raise InputError(
            f"{shown} is not a spam-finetune classifier (no class head, or its metadata lacks "
            f"{missing}): run `dvc repro spam-finetune`, or point --model at its output"
        )
    if args.raw_dir is None and source.bpe_files is not None:
        tokenizer = gpt2_tokenizer(*source.bpe_files)
    else:
        tokenizer = load_tokenizer(bpe_folder(args.raw_dir))
    probs = classify_texts(
        model,
        tokenizer,
        texts,
        max_length=int(metadata["max_length"]),
        pooling=metadata["pooling"],
        batch_size=batch_size,
    )
    labels = {int(index): name for index, name in metadata["labels"].items()}
    for text, p in zip(texts, probs, strict=True):
        best = int(p.argmax())
        if args.json:
            print(json.dumps({"label": labels[best], "probability": round(float(p[best]), 6), "text": text}))
        else:
            print(f"{labels[best]}\t{p[best]:.4f}\t{_shown(text)}")
    return 0


def _read_texts(texts: list[str], file: str | None) -> list[str]:
    """The messages to classify: arguments first, then the lines of `file` (stdin for '-').

    `file` may be any file that reads to its end: a pipe (`<(command)`, /dev/stdin) as well as a
    regular file.
    """
    messages = list(texts)
    if file is not None:
        if file == "-":
            buffer = getattr(sys.stdin, "buffer", None)  # bytes, decoded below; absent if already text
            lines = _decode_lines(_capped(buffer or sys.stdin, "<stdin>"), "<stdin>")
        else:
            path = Path(file)
            if path.is_dir():
                raise IsADirectoryError(f"--file {path}: is a directory, not a file")
            if not path.exists():
                raise FileNotFoundError(f"--file {path}: no such file")
            with path.open("rb") as fh:
                lines = _decode_lines(_capped(fh, str(path)), str(path))
        messages += [line for line in lines if line.strip()]
    if not messages:
        raise InputError("nothing to classify: give messages as arguments, or --file PATH ('-' for stdin)")
    return messages


def _capped(stream: IO[Any], name: str) -> bytes | str:
    """All of `stream`, refused past MAX_INPUT_BYTES: /dev/zero or an endless pipe has no end to read to."""
    data = stream.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise InputError(
            f"--file {name}: more than {MAX_INPUT_BYTES >> 20} MiB of messages, the most one call reads; "
            "split the file, or is it endless?"
        )
    return data


def _shown(text: str) -> str:
    """The message as printed beside its label: on one line, cut after SHOWN_CHARS characters, its
    control characters escaped (`\\u202e`): a raw bidi override or escape code garbles the terminal."""
    line = " ".join(text.split())
    line = line if len(line) <= SHOWN_CHARS else f"{line[:SHOWN_CHARS]}… ({len(text):,} characters)"
    return "".join(
        char.encode("unicode_escape").decode("ascii") if is_control(char) else char for char in line
    )


def _decode_lines(data: bytes | str, name: str) -> list[str]:
    """The lines of UTF-8 `data`; text in another encoding is an InputError naming the file and line."""
    if isinstance(data, str):  # a text stream, decoded already
        return data.splitlines()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            f"--file {name}, line {line}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "save the file as UTF-8"
        ) from exc
