"""Your own labelled file for the classifier (tokenize.spam): CSV, TSV and JSONL, and every bad input.

The rows are the worked example's 40 support tickets (examples/own-data/labels.csv), written
again as TSV and JSONL; the bad inputs are small files, each refused with one line naming the
file and the row, line or key, before anything is written.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import tiktoken
import yaml

from gptlab.data import spam
from gptlab.errors import EXIT_USAGE, InputError
from gptlab.pipeline.stage import stage_main
from stages import tokenize_data

from helpers import PROJECT_ROOT, committed_params_raw

EXAMPLE = PROJECT_ROOT / "examples" / "own-data" / "labels.csv"
CLASSES = ("billing", "bug", "feature")
# The example's split: 40 rows are few, and every split must hold every class.
FRACTIONS = {"seed": 123, "train_frac": 0.6, "val_frac": 0.2}


def example_rows() -> list[dict[str, str]]:
    with EXAMPLE.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def write_as(path: Path, kind: str, rows: list[dict[str, Any]]) -> Path:
    """`rows` as a CSV or TSV file with a header line, or as JSONL (one object per line)."""
    if kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    else:
        pd.DataFrame(rows).to_csv(path, sep="\t" if kind == "tsv" else ",", index=False)
    return path


def own(kind: str = "csv", labels: Any = "sorted", text: str = "text", label: str = "label") -> spam.OwnFile:
    return spam.OwnFile(kind, text, label, labels)


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl"])
def test_each_kind_of_file_gives_the_same_splits(
    kind: str, tmp_path: Path, tokenizer: tiktoken.Encoding
) -> None:
    source = EXAMPLE if kind == "csv" else write_as(tmp_path / f"labels.{kind}", kind, example_rows())
    processed = tmp_path / "processed"
    counts = spam.prepare(source, processed, tokenizer, **FRACTIONS, own=own(kind))

    # Downsampled as the book does: each class cut to the smallest one's 13 rows.
    assert counts["raw"] == {"rows": 40, "billing": 14, "bug": 13, "feature": 13}
    assert sum(counts[split]["rows"] for split in spam.SPLITS) == 39
    assert [counts[split]["rows"] for split in spam.SPLITS] == [23, 7, 9]
    assert json.loads((processed / "spam" / "labels.json").read_text(encoding="utf-8")) == list(CLASSES)
    reference = spam.prepare(EXAMPLE, tmp_path / "reference", tokenizer, **FRACTIONS, own=own("csv"))
    assert counts == reference
    for split in spam.SPLITS:
        dataset = spam.SpamDataset(processed, split)
        assert dataset.class_names == CLASSES
        assert set(dataset.labels) == {0, 1, 2}  # every class in every split
        again = pd.read_csv(tmp_path / "reference" / "spam" / f"{split}.csv")
        assert dataset.texts == again["text"].tolist() and dataset.labels == again["label"].tolist()
        by_text = {row["text"]: row["label"] for row in example_rows()}
        assert all(by_text[t] == CLASSES[i] for t, i in zip(dataset.texts, dataset.labels, strict=True))


def test_declared_label_order_and_no_balancing(tmp_path: Path, tokenizer: tiktoken.Encoding) -> None:
    declared = ["feature", "bug", "billing"]
    counts = spam.prepare(EXAMPLE, tmp_path, tokenizer, **FRACTIONS, balance="none", own=own(labels=declared))
    assert sum(counts[split]["rows"] for split in spam.SPLITS) == 40  # every row kept
    train = spam.SpamDataset(tmp_path, "train")
    assert train.class_names == tuple(declared)
    by_text = {row["text"]: row["label"] for row in example_rows()}
    assert all(by_text[t] == declared[i] for t, i in zip(train.texts, train.labels, strict=True))


def test_the_collection_writes_no_class_names_and_drops_stale_ones(
    tmp_path: Path, tokenizer: tiktoken.Encoding, shared_data: Path
) -> None:
    spam.prepare(EXAMPLE, tmp_path, tokenizer, **FRACTIONS, own=own())
    collection = shared_data / "sms_spam_collection" / "SMSSpamCollection"
    counts = spam.prepare(collection, tmp_path, tokenizer, seed=123, train_frac=0.7, val_frac=0.1, max_rows=8)
    assert not (tmp_path / "spam" / spam.LABELS_FILE).exists()
    assert spam.SpamDataset(tmp_path, "test").class_names == ("ham", "spam")
    assert set(counts["train"]) == {"rows", "ham", "spam", "tokens", "truncated"}


TICKETS = [{"text": f"ticket {i} about {c}", "label": c} for c in CLASSES for i in range(6)]
NOT_UTF8 = b"text,label\nfine,bug\n" + "caf\u00e9 au lait,billing\n".encode("latin-1")


def bad_files() -> list[tuple[str, str, Any, dict[str, Any], str]]:
    """(case, kind, file content, prepare's keywords, the error's regex after the file name)."""
    rows = TICKETS
    return [
        (
            "no text column",
            "csv",
            [{"body": r["text"], "label": r["label"]} for r in rows],
            {},
            r": no column 'text' \(tokenize.spam.text_column\); its columns are \['body', 'label'\]",
        ),
        (
            "no label column",
            "tsv",
            [{"text": r["text"]} for r in rows],
            {},
            r": no column 'label' \(tokenize.spam.label_column\)",
        ),
        (
            "no label key",
            "jsonl",
            [{"text": "a", "label": "bug"}, {"text": "b"}],
            {},
            r", line 2: no key 'label' \(tokenize.spam.label_column\)",
        ),
        (
            "label not declared",
            "csv",
            rows,
            {"labels": ["billing", "bug"]},
            r", row 13: label 'feature' is not in tokenize.spam.labels \['billing', 'bug'\]",
        ),
        (
            "one class",
            "csv",
            [r for r in rows if r["label"] == "bug"],
            {},
            r": 1 class \(\['bug'\]\): a classifier needs at least 2",
        ),
        (
            "class missing from a split",
            "csv",
            [*rows[:6], *rows[6:12], *rows[12:13]],
            {"balance": "none"},
            r": class 'feature' has no example in the (train|val|test) split",
        ),
        (
            "empty split",
            "csv",
            rows,
            {"max_rows": None, "train_frac": 0.9, "val_frac": 0.05},
            r": the val split has 0 rows",
        ),
        ("not UTF-8", "csv", NOT_UTF8, {}, r", line 3: not UTF-8 text"),
        (
            "JSONL row not JSON",
            "jsonl",
            '{"text": "a", "label": "bug"}\n{"text": "b", label: bug}\n',
            {},
            r", line 2: not JSON",
        ),
        (
            "declared class absent",
            "csv",
            [r for r in rows if r["label"] != "feature"],
            {"labels": list(CLASSES)},
            r": class 'feature' of tokenize.spam.labels has no example in the file",
        ),
        ("empty text", "csv", [*rows, {"text": " ", "label": "bug"}], {}, r", row 19: empty text"),
    ]


@pytest.mark.parametrize(
    ("case", "kind", "content", "keywords", "problem"), bad_files(), ids=[c[0] for c in bad_files()]
)
def test_bad_input_is_one_line_naming_the_file_and_row_and_writes_nothing(
    case: str,
    kind: str,
    content: Any,
    keywords: dict[str, Any],
    problem: str,
    tmp_path: Path,
    tokenizer: tiktoken.Encoding,
) -> None:
    path = tmp_path / f"labels.{kind}"
    if isinstance(content, list):
        write_as(path, kind, content)
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    labels = keywords.pop("labels", "sorted")
    split = {**FRACTIONS, **keywords}
    with pytest.raises(InputError) as caught:
        spam.prepare(path, tmp_path / "processed", tokenizer, **split, own=own(kind, labels))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert re.search(problem, message), message
    assert not (tmp_path / "processed").exists()


def test_the_stage_exits_2_on_a_bad_file_before_writing_anything(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    params = committed_params_raw()
    params["data"]["raw_dir"] = str(shared_data)
    labels = write_as(tmp_path / "labels.jsonl", "jsonl", TICKETS)
    with labels.open("a", encoding="utf-8") as fh:
        fh.write("not json at all\n")
    params["tokenize"]["spam"].update(file="labels.jsonl", format="jsonl", **FRACTIONS)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    monkeypatch.chdir(tmp_path)

    with pytest.raises(SystemExit) as stopped:
        stage_main(tokenize_data.run, None, ["--params", "params.yaml"])

    assert stopped.value.code == EXIT_USAGE
    assert capsys.readouterr().err == "error: labels.jsonl, line 19: not JSON (Expecting value at column 1)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.jsonl", "params.yaml"]


@pytest.mark.slow
def test_the_stage_reads_your_file_and_logs_it_as_a_dataset_input(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, isolated_tools: str
) -> None:
    import mlflow

    params = committed_params_raw()
    params["data"]["raw_dir"] = str(shared_data)
    params["tokenize"]["spam"].update(file="tickets.jsonl", format="jsonl", **FRACTIONS)
    params["tracking"]["system_metrics"] = False
    labels = write_as(tmp_path / "tickets.jsonl", "jsonl", example_rows())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    monkeypatch.chdir(tmp_path)

    stage_main(tokenize_data.run, None, ["--params", "params.yaml"])

    counts = json.loads(Path("reports/tokenize/counts.json").read_text(encoding="utf-8"))
    assert counts["spam"]["raw"] == {"rows": 40, "billing": 14, "bug": 13, "feature": 13}
    assert spam.SpamDataset("data/processed", "val").class_names == CLASSES
    client = mlflow.MlflowClient(isolated_tools)
    run = client.search_runs([client.get_experiment_by_name("gptlab").experiment_id])[0]
    dataset = {d.dataset.name: d for d in run.inputs.dataset_inputs}["spam"]
    # DVC's content hash of the file, as dvc.lock records it for the stage's dependency.
    assert dataset.dataset.digest == hashlib.md5(labels.read_bytes()).hexdigest()
    assert json.loads(dataset.dataset.profile) == {"train_rows": 23, "val_rows": 7, "test_rows": 9}
    assert {t.key: t.value for t in dataset.tags}["gptlab.path"] == "tickets.jsonl"
    assert run.data.params["tokenize.spam.format"] == "jsonl"
