"""Labelled texts for the classifier: the SMS Spam Collection prepared as chapter 6 does, or your own file.

Preparation: read the labelled rows (the collection with pandas, tab-separated,
default quoting: 4,825 ham and 747 spam; or a CSV, TSV or JSONL file of your own,
its text and label columns named in params), cut every class to the smallest
one's count as the book undersamples ham (or keep them all), shuffle, split
70/10/20, encode, and pad every text with <|endoftext|> to the longest training
text; validation and test texts are truncated to that same length. Every check
runs before anything is written. The class names of your own file are written
beside the splits (labels.json); the collection's are ham and spam.
pandas is imported by the functions that read and write frames, not with the module.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import tiktoken
import torch
from torch.utils.data import Dataset

from gptlab.data.token_ids import load_token_ids
from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.model.tokenizer import END_OF_TEXT_ID, gpt2_tokenizer

if TYPE_CHECKING:
    import pandas as pd

SUBDIR = "spam"
SPLITS = ("train", "val", "test")
LABELS = {"ham": 0, "spam": 1}
# The class names of your own file, in class-id order, beside its splits (the collection has none).
LABELS_FILE = "labels.json"
Format = Literal["sms", "csv", "tsv", "jsonl"]
Balance = Literal["downsample", "none"]
# The counts' own keys beside each class's count in reports/tokenize/counts.json: no class name.
COUNT_KEYS = ("rows", "tokens", "truncated")
# A class name becomes a metric's name (MLflow's and DVC's, where a dot nests): letters, digits, _ - and spaces.
CLASS_NAME = re.compile(r"[\w\- ]+")


@dataclass(frozen=True)
class SpamSplits:
    """Three frames with columns text, label (the class id), and the class names by id (ham=0, spam=1)."""

    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame
    classes: tuple[str, ...] = tuple(LABELS)

    def items(self) -> list[tuple[str, pd.DataFrame]]:
        return [("train", self.train), ("val", self.val), ("test", self.test)]


def read_collection(path: Path | str) -> pd.DataFrame:
    """The raw collection as the book reads it: columns Label ("ham"/"spam") and Text."""
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: run `dvc repro download` (or set GPTLAB_MIRROR), or point "
            "tokenize.spam.file at the collection"
        )
    df = pd.read_csv(path, sep="\t", header=None, names=["Label", "Text"])
    unknown = sorted(set(df["Label"]) - set(LABELS))
    if unknown:
        raise InputError(f"{path}: unexpected labels {unknown[:5]}; expected only {sorted(LABELS)}")
    if df["Text"].isna().any():
        row = int(df.index[df["Text"].isna()][0])
        raise InputError(f"{path}: row {row} has no message text")
    return df


def read_labelled(
    path: Path | str,
    fmt: Literal["csv", "tsv", "jsonl"],
    *,
    text_column: str,
    label_column: str,
    labels: Sequence[str] | Literal["sorted"],
) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """Your own labelled file as the collection reads: columns Label and Text, and the class names.

    The class names are `labels` in that order (every row's label must be one of them), or the
    labels found, sorted. A problem is an InputError naming the file and its row (CSV/TSV: the
    data row after the header) or line (JSONL).
    """
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: tokenize.spam.file names no file")
    text = _utf8_text(path)
    if fmt == "jsonl":
        rows = _jsonl_rows(path, text, text_column, label_column)
    else:
        rows = _table_rows(path, text, "\t" if fmt == "tsv" else ",", text_column, label_column)
    for where, message, label in rows:
        if not message.strip():
            raise InputError(f"{path}, {where}: empty text ({text_column!r})")
        if not label.strip():
            raise InputError(f"{path}, {where}: empty label ({label_column!r})")
        if labels != "sorted" and label not in labels:
            raise InputError(
                f"{path}, {where}: label {label!r} is not in tokenize.spam.labels {list(labels)}"
            )
    found = {label for _, _, label in rows}
    classes = tuple(sorted(found)) if labels == "sorted" else tuple(labels)
    _require_classes(path, classes, found)
    frame = pd.DataFrame({"Label": [row[2] for row in rows], "Text": [row[1] for row in rows]})
    return frame, classes


def _require_classes(path: Path, classes: tuple[str, ...], found: set[str]) -> None:
    """At least two classes, each with an example, none named like a count in the reports."""
    if len(found) < 2:
        raise InputError(
            f"{path}: {len(found)} class{'es' if len(found) != 1 else ''} ({sorted(found)}): a classifier "
            "needs at least 2; label rows of another class, or check tokenize.spam.label_column"
        )
    for name in classes:
        if name not in found:
            raise InputError(f"{path}: class {name!r} of tokenize.spam.labels has no example in the file")
        if name in COUNT_KEYS:
            raise InputError(f"{path}: a class may not be named {name!r} (one of {list(COUNT_KEYS)})")
        if not CLASS_NAME.fullmatch(name):
            raise InputError(
                f"{path}: class {name!r}: a class name names metrics, so it may hold only letters, "
                "digits, _, - and spaces"
            )


def _utf8_text(path: Path) -> str:
    """The file's text; not UTF-8 is an InputError naming the line (a leading byte-order mark is dropped)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            f"{path}, line {line}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8"
        ) from exc


def _table_rows(
    path: Path, text: str, sep: str, text_column: str, label_column: str
) -> list[tuple[str, str, str]]:
    """(where, text, label) of each data row of a CSV or TSV file with a header line."""
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    try:
        # Every cell a string, and "NA" or "null" stays text, not a missing value.
        frame = pd.read_csv(io.StringIO(text), sep=sep, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise InputError(f"{path}: not a {'TSV' if sep == chr(9) else 'CSV'} file ({exc})") from exc
    for column, key in ((text_column, "text_column"), (label_column, "label_column")):
        if column not in frame.columns:
            raise InputError(
                f"{path}: no column {column!r} (tokenize.spam.{key}); its columns are {list(frame.columns)}"
            )
    texts, labels = frame[text_column].tolist(), frame[label_column].tolist()
    return [(f"row {i}", t, lab) for i, (t, lab) in enumerate(zip(texts, labels, strict=True), 1)]


def _jsonl_rows(path: Path, text: str, text_column: str, label_column: str) -> list[tuple[str, str, str]]:
    """(where, text, label) of each JSON object of a JSONL file, one per line; blank lines are skipped."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}, {where}: not JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(record, dict):
            raise InputError(f"{path}, {where}: expected a JSON object, got {type(record).__name__}")
        values = []
        # A label may be a number (0, 1, 2), which names its class as text; a text is a string.
        for key, setting, kinds in (
            (text_column, "text_column", str),
            (label_column, "label_column", str | int),
        ):
            if key not in record:
                raise InputError(f"{path}, {where}: no key {key!r} (tokenize.spam.{setting})")
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise InputError(f"{path}, {where}: {key!r} is {type(value).__name__}, expected a string")
            values.append(str(value))
        rows.append((where, values[0], values[1]))
    if not rows:
        raise InputError(f"{path}: no JSON rows")
    return rows


def balance_and_split(
    df: pd.DataFrame,
    *,
    seed: int,
    train_frac: float,
    val_frac: float,
    max_rows: int | None = None,
    classes: Sequence[str] = tuple(LABELS),
    balance: Balance = "downsample",
) -> SpamSplits:
    """The book's create_balanced_dataset + random_split, with labels mapped to class ids.

    `downsample` draws every class larger than the smallest down to its count (the book draws
    ham down to the spam count and keeps the spam as it is); `none` keeps every row.
    `max_rows` keeps only the first rows of each split, for smoke runs. The fractions and
    `max_rows` come checked by the params schema (`config.SpamSplit`).
    """
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    by_class = [df[df["Label"] == name] for name in classes]
    if balance == "downsample":
        smallest = min(len(part) for part in by_class)
        by_class = [
            part.sample(smallest, random_state=seed) if len(part) > smallest else part for part in by_class
        ]
    balanced = pd.concat(by_class)
    balanced = balanced.assign(Label=balanced["Label"].map({name: i for i, name in enumerate(classes)}))
    shuffled = balanced.sample(frac=1, random_state=seed).reset_index(drop=True)
    shuffled = pd.DataFrame({"text": shuffled["Text"], "label": shuffled["Label"].astype(np.int64)})
    train_end = int(len(shuffled) * train_frac)
    val_end = train_end + int(len(shuffled) * val_frac)
    parts = (shuffled[:train_end], shuffled[train_end:val_end], shuffled[val_end:])
    train, val, test = (part.head(max_rows) if max_rows else part for part in parts)
    return SpamSplits(*(part.reset_index(drop=True) for part in (train, val, test)), classes=tuple(classes))


def require_classes_in_splits(splits: SpamSplits, path: Path | str) -> None:
    """Every split holds rows, and an example of every class: else no score of it means anything."""
    for split, frame in splits.items():
        if frame.empty:
            raise InputError(
                f"{path}: the {split} split has 0 rows: label more rows, or change tokenize.spam's "
                "train_frac/val_frac (or max_rows)"
            )
        present = set(frame["label"].tolist())
        for index, name in enumerate(splits.classes):
            if index not in present:
                raise InputError(
                    f"{path}: class {name!r} has no example in the {split} split ({len(frame)} rows): "
                    "label more rows of it, or change tokenize.spam's train_frac/val_frac"
                )


def encode_texts(texts: list[str], tokenizer: tiktoken.Encoding) -> list[list[int]]:
    """Messages as ordinary text: a literal "<|endoftext|>" in an SMS is not the special token."""
    return tokenizer.encode_batch(texts, disallowed_special=())


def pad_ids(encoded: list[list[int]], max_length: int, pad_token_id: int = END_OF_TEXT_ID) -> np.ndarray:
    """(n, max_length) int32 matrix: each row truncated to max_length, then right-padded."""
    matrix = np.full((len(encoded), max_length), pad_token_id, dtype=np.int32)
    for row, ids in enumerate(encoded):
        ids = ids[:max_length]
        matrix[row, : len(ids)] = ids
    return matrix


def split_paths(processed_dir: Path | str, split: str) -> tuple[Path, Path]:
    """(csv, npy) paths of one split."""
    if split not in SPLITS:
        raise InputError(f"unknown spam split {split!r}; choose one of {list(SPLITS)}")
    base = Path(processed_dir) / SUBDIR
    return base / f"{split}.csv", base / f"{split}.npy"


def save_split(processed_dir: Path | str, split: str, frame: pd.DataFrame, ids: np.ndarray) -> None:
    assert len(frame) == len(ids), f"{split}: {len(frame)} rows but {len(ids)} encoded rows"
    csv_path, npy_path = split_paths(processed_dir, split)
    with atomic_path(csv_path) as tmp:
        frame[["text", "label"]].to_csv(tmp, index=False)
    with atomic_path(npy_path) as tmp, tmp.open("wb") as fh:
        np.save(fh, ids.astype(np.int32, copy=False))


def read_split_csv(path: Path) -> pd.DataFrame:
    # pandas on first use: keeps a stage's start-up fast
    import pandas as pd

    # keep_default_na=False: a message reading "NA" or "null" stays text, not a missing value.
    return pd.read_csv(path, dtype={"text": str, "label": np.int64}, keep_default_na=False)


class SpamDataset(Dataset):
    """One prepared split: items (input_ids LongTensor[max_length], label LongTensor scalar).

    Rows are padded with 50256 to `max_length`, the longest training message;
    `texts` and `labels` hold the messages and their class ids (ham=0, spam=1), `class_names`
    the name of each class id.
    """

    def __init__(self, processed_dir: Path | str, split: str) -> None:
        csv_path, npy_path = split_paths(processed_dir, split)
        for path in (csv_path, npy_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: run `dvc repro tokenize` first")
        frame = read_split_csv(csv_path)
        ids = load_token_ids(npy_path)
        if ids.ndim != 2 or len(ids) != len(frame):
            raise InputError(
                f"{npy_path} holds shape {ids.shape} but {csv_path} has {len(frame)} rows: "
                "rerun `dvc repro tokenize`"
            )
        self.texts: list[str] = frame["text"].tolist()
        self.labels: list[int] = frame["label"].tolist()
        self.class_names = class_names(processed_dir)
        self.max_length: int = int(ids.shape[1])
        self.input_ids = torch.from_numpy(ids.astype(np.int64))  # (n, max_length)
        self.label_ids = torch.tensor(self.labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[idx], self.label_ids[idx]

    def reencode(self, tokenizer: tiktoken.Encoding, max_length: int) -> None:
        """Encode the messages again, each cut to `max_length` tokens and padded to it (in place).

        What the bonus script's SpamDataset does with a given max_length: a longer length keeps
        more of a validation or test message than the tokenize stage's cut to the longest
        training message did. `max_length` is spam.max_length as the params schema checked it
        (a positive number), or the base model's context length.
        """
        ids = pad_ids(encode_texts(self.texts, tokenizer), max_length)
        self.input_ids = torch.from_numpy(ids.astype(np.int64))  # (n, max_length)
        self.max_length = max_length


def fit_to_context(
    datasets: Mapping[str, SpamDataset],
    max_length: int | Literal["context"] | None,
    context_length: int,
    bpe_files: tuple[Path, Path],
    base_dir: Path,
) -> None:
    """The splits encoded again to `max_length` (spam.max_length) when it is set, in place, and
    checked against the `context_length` of the base model in `base_dir`."""
    if max_length is not None:
        length = context_length if max_length == "context" else max_length
        tokenizer = gpt2_tokenizer(*bpe_files)
        for dataset in datasets.values():
            dataset.reencode(tokenizer, length)
    padded = datasets["train"].max_length
    if padded > context_length:
        raise InputError(
            f"spam messages are padded to {padded} tokens but {base_dir} reads at most "
            f"{context_length}: use a base model with a longer context, or set spam.max_length "
            'to at most that ("context" pads to the model\'s context length)'
        )


@dataclass(frozen=True)
class OwnFile:
    """How to read a labelled file of your own (tokenize.spam: format, columns, label order)."""

    format: Literal["csv", "tsv", "jsonl"]
    text_column: str
    label_column: str
    labels: Sequence[str] | Literal["sorted"]


def load_splits(
    path: Path | str,
    *,
    seed: int,
    train_frac: float,
    val_frac: float,
    max_rows: int | None = None,
    balance: Balance = "downsample",
    own: OwnFile | None = None,
) -> tuple[pd.DataFrame, SpamSplits]:
    """The raw rows (Label, Text) and their checked splits: every check of the data, before any write.

    `own` None reads the SMS Spam Collection as the book does.
    """
    if own is None:
        raw, classes = read_collection(path), tuple(LABELS)
    else:
        raw, classes = read_labelled(
            path, own.format, text_column=own.text_column, label_column=own.label_column, labels=own.labels
        )
    splits = balance_and_split(
        raw,
        seed=seed,
        train_frac=train_frac,
        val_frac=val_frac,
        max_rows=max_rows,
        classes=classes,
        balance=balance,
    )
    require_classes_in_splits(splits, path)
    return raw, splits


def prepare(
    collection_path: Path | str,
    processed_dir: Path | str,
    tokenizer: tiktoken.Encoding,
    *,
    seed: int,
    train_frac: float,
    val_frac: float,
    max_rows: int | None = None,
    balance: Balance = "downsample",
    own: OwnFile | None = None,
) -> dict[str, Any]:
    """Read, balance, split, encode and pad the texts, save every split; returns counts and class balance."""
    raw, splits = load_splits(
        collection_path,
        seed=seed,
        train_frac=train_frac,
        val_frac=val_frac,
        max_rows=max_rows,
        balance=balance,
        own=own,
    )
    return write_splits(raw, splits, processed_dir, tokenizer, own=own is not None)


def write_splits(
    raw: pd.DataFrame,
    splits: SpamSplits,
    processed_dir: Path | str,
    tokenizer: tiktoken.Encoding,
    *,
    own: bool,
) -> dict[str, Any]:
    """Encode and pad the checked splits and save them (with the class names of your own file)."""
    encoded = {name: encode_texts(frame["text"].tolist(), tokenizer) for name, frame in splits.items()}
    max_length = max(len(ids) for ids in encoded["train"])
    raw_counts = raw["Label"].value_counts()
    metrics: dict[str, Any] = {
        "raw": {"rows": len(raw), **{name: int(raw_counts.get(name, 0)) for name in splits.classes}},
        "max_length": max_length,
    }
    for name, frame in splits.items():
        save_split(processed_dir, name, frame, pad_ids(encoded[name], max_length))
        lengths = [len(ids) for ids in encoded[name]]
        metrics[name] = {
            "rows": len(frame),
            **{label: int((frame["label"] == i).sum()) for i, label in enumerate(splits.classes)},
            "tokens": sum(min(n, max_length) for n in lengths),
            "truncated": sum(n > max_length for n in lengths),
        }
    labels_path = Path(processed_dir) / SUBDIR / LABELS_FILE
    if own:
        with atomic_path(labels_path) as tmp:
            tmp.write_text(json.dumps(list(splits.classes), ensure_ascii=False) + "\n", encoding="utf-8")
    else:  # the collection's names are ham and spam: no file, as before there were others
        labels_path.unlink(missing_ok=True)
    return metrics


def class_names(processed_dir: Path | str) -> tuple[str, ...]:
    """The class names by class id of the prepared splits: your file's (labels.json), or ham and spam."""
    path = Path(processed_dir) / SUBDIR / LABELS_FILE
    if not path.is_file():
        return tuple(LABELS)
    names = json.loads(path.read_text(encoding="utf-8"))
    if not (isinstance(names, list) and len(names) >= 2 and all(isinstance(n, str) for n in names)):
        raise InputError(f"{path}: expected a list of at least 2 class names: rerun `dvc repro tokenize`")
    return tuple(names)
