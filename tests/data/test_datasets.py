"""The Verdict windows, the spam splits, and the tokenize stage's files, metrics and determinism;
a damaged token-ids file is refused naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import tiktoken
import torch
from torch.utils.data import DataLoader

from gptlab.data import spam, verdict
from gptlab.errors import GptlabError
from gptlab.model.tokenizer import END_OF_TEXT_ID
from gptlab.pipeline.params import Params
from stages import tokenize_data as tokenize_stage

from helpers import committed_params, copy_empty_store, snapshot


def stage_params(raw_dir: Path, processed_dir: Path) -> Params:
    params = committed_params()
    data = dataclasses.replace(params.data, raw_dir=str(raw_dir), processed_dir=str(processed_dir))
    # The labelled texts: the collection, wherever raw_dir now is.
    spam_split = dataclasses.replace(params.tokenize.spam, file=str(raw_dir / data.sources.sms_spam.path))
    tokenize = dataclasses.replace(params.tokenize, spam=spam_split)
    return dataclasses.replace(params, data=data, tokenize=tokenize)


def run_stage(workdir: Path, raw_dir: Path, mlflow_db: Path) -> Path:
    """Run the tokenize stage with workdir as the project root; returns the processed folder."""
    processed = workdir / "data" / "processed"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{mlflow_db}")
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        tokenize_stage.run(stage_params(raw_dir, processed))
    return processed


@pytest.fixture(scope="module")
def prepared(
    tmp_path_factory: pytest.TempPathFactory, shared_data: Path, empty_store: Path
) -> Iterator[Path]:
    """The whole tokenize stage, run once on the real data; yields the project folder it ran in.

    Its MLflow store (mlflow.db there) is reused by this module's other stage runs: a new store costs seconds.
    """
    workdir = tmp_path_factory.mktemp("tokenize")
    copy_empty_store(empty_store, workdir / "mlflow.db")
    run_stage(workdir, shared_data, workdir / "mlflow.db")
    yield workdir


def processed_files(processed: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(processed)): p.read_bytes() for p in sorted(processed.rglob("*")) if p.is_file()
    }


# --------------------------------------------------------------------------- #
# The Verdict
# --------------------------------------------------------------------------- #


def test_split_text_by_characters() -> None:
    text = "abcdefghij" * 7
    train, val = verdict.split_text(text, 0.9)
    assert len(train) == int(0.9 * 70) == 63
    assert train + val == text
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="train_ratio"):
            verdict.split_text(text, bad)


def test_book_chapter2_windows(tokenizer: tiktoken.Encoding, shared_data: Path) -> None:
    ids = verdict.encode((shared_data / "the-verdict.txt").read_text(encoding="utf-8"), tokenizer)
    # Stride 1: the book's first two batches of create_dataloader_v1(max_length=4, stride=1).
    overlapping = verdict.GPTDatasetV1(ids, max_length=4, stride=1)
    assert [t.tolist() for t in overlapping[0]] == [[40, 367, 2885, 1464], [367, 2885, 1464, 1807]]
    assert [t.tolist() for t in overlapping[1]] == [[367, 2885, 1464, 1807], [2885, 1464, 1807, 3619]]
    # Stride 4, batch 8: the book's first batch of inputs, no overlap between rows.
    inputs, targets = next(iter(DataLoader(verdict.GPTDatasetV1(ids, max_length=4, stride=4), batch_size=8)))
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.tolist()[:3] == [[40, 367, 2885, 1464], [1807, 3619, 402, 271], [10899, 2138, 257, 7026]]
    assert inputs.tolist()[7] == [284, 3285, 326, 11]
    torch.testing.assert_close(targets[:, :-1], inputs[:, 1:])
    torch.testing.assert_close(targets[:-1, -1], inputs[1:, 0])


def test_windows_cover_the_book_range() -> None:
    ids = np.arange(103, dtype=np.int32)
    ds = verdict.GPTDatasetV1(ids, max_length=10, stride=7)
    # The book: range(0, len(ids) - max_length, stride).
    starts = list(range(0, 103 - 10, 7))
    assert len(ds) == len(starts)
    for i, start in enumerate(starts):
        x, y = ds[i]
        assert x.tolist() == list(range(start, start + 10))
        assert y.tolist() == list(range(start + 1, start + 11))
    with pytest.raises(IndexError):
        ds[len(starts)]


def test_window_errors() -> None:
    with pytest.raises(ValueError, match="max_length=8"):
        verdict.GPTDatasetV1(list(range(8)), max_length=8, stride=8)
    with pytest.raises(ValueError, match="positive"):
        verdict.GPTDatasetV1(list(range(20)), max_length=4, stride=0)


def test_verdict_splits(prepared: Path, tokenizer: tiktoken.Encoding, shared_data: Path) -> None:
    processed = prepared / "data" / "processed"
    text = (shared_data / "the-verdict.txt").read_text(encoding="utf-8")
    train, val = verdict.load_split(processed, "train"), verdict.load_split(processed, "val")
    assert train.dtype == val.dtype == np.int32
    split_idx = int(0.9 * len(text))
    assert tokenizer.decode(train.tolist()) == text[:split_idx]
    assert tokenizer.decode(val.tolist()) == text[split_idx:]
    # Chapter 5's loaders (max_length = stride = 256): 4,608 training and 512 validation tokens.
    assert len(verdict.GPTDatasetV1(train, 256, 256)) * 256 == 4_608
    assert len(verdict.GPTDatasetV1(val, 256, 256)) * 256 == 512
    with pytest.raises(FileNotFoundError, match="dvc repro tokenize"):
        verdict.load_split(prepared / "nowhere", "train")
    with pytest.raises(ValueError, match="split"):
        verdict.load_split(processed, "test")


# --------------------------------------------------------------------------- #
# SMS spam
# --------------------------------------------------------------------------- #


def test_spam_as_the_book_reads_it(shared_data: Path) -> None:
    raw = spam.read_collection(shared_data / "sms_spam_collection" / "SMSSpamCollection")
    assert raw["Label"].value_counts().to_dict() == {"ham": 4_825, "spam": 747}
    splits = spam.balance_and_split(raw, seed=123, train_frac=0.7, val_frac=0.1)
    assert [len(frame) for _, frame in splits.items()] == [1_045, 149, 300]
    combined = pd.concat([frame for _, frame in splits.items()])
    assert combined["label"].value_counts().to_dict() == {0: 747, 1: 747}
    # Every spam message is kept; the ham is a subset; no message lands in two splits' rows twice.
    assert set(combined.loc[combined["label"] == 1, "text"]) == set(raw.loc[raw["Label"] == "spam", "Text"])
    assert set(combined.loc[combined["label"] == 0, "text"]) <= set(raw.loc[raw["Label"] == "ham", "Text"])
    other_seed = spam.balance_and_split(raw, seed=7, train_frac=0.7, val_frac=0.1)
    assert not other_seed.train["text"].equals(splits.train["text"])


def test_spam_files(prepared: Path, tokenizer: tiktoken.Encoding) -> None:
    processed = prepared / "data" / "processed"
    datasets = {split: spam.SpamDataset(processed, split) for split in spam.SPLITS}
    assert {split: len(ds) for split, ds in datasets.items()} == {"train": 1_045, "val": 149, "test": 300}
    assert {ds.max_length for ds in datasets.values()} == {120}
    train_lengths = [len(tokenizer.encode(text)) for text in datasets["train"].texts]
    assert max(train_lengths) == 120
    for split, ds in datasets.items():
        assert set(ds.labels) == {0, 1}
        assert pd.read_csv(processed / "spam" / f"{split}.csv").columns.tolist() == ["text", "label"]
        for i in (0, len(ds) // 2, len(ds) - 1):
            input_ids, label = ds[i]
            assert input_ids.shape == (120,) and input_ids.dtype == torch.long
            assert label.ndim == 0 and label.item() == ds.labels[i]
            ids = tokenizer.encode(ds.texts[i])[:120]
            assert input_ids[: len(ids)].tolist() == ids
            assert (input_ids[len(ids) :] == END_OF_TEXT_ID).all()
    batch_ids, batch_labels = next(iter(DataLoader(datasets["val"], batch_size=8)))
    assert batch_ids.shape == (8, 120) and batch_labels.shape == (8,)


def test_spam_max_rows_and_truncation(
    tmp_path: Path, tokenizer: tiktoken.Encoding, shared_data: Path
) -> None:
    raw = spam.read_collection(shared_data / "sms_spam_collection" / "SMSSpamCollection")
    full = spam.balance_and_split(raw, seed=123, train_frac=0.7, val_frac=0.1)
    small = spam.balance_and_split(raw, seed=123, train_frac=0.7, val_frac=0.1, max_rows=5)
    for (_, whole), (_, head) in zip(full.items(), small.items(), strict=True):
        pd.testing.assert_frame_equal(head, whole.head(5))
    matrix = spam.pad_ids([[1, 2, 3, 4, 5], [6]], max_length=3)
    assert matrix.tolist() == [[1, 2, 3], [6, END_OF_TEXT_ID, END_OF_TEXT_ID]]
    assert matrix.dtype == np.int32


def test_spam_bad_input(tmp_path: Path, tokenizer: tiktoken.Encoding, shared_data: Path) -> None:
    bad = tmp_path / "SMSSpamCollection"
    bad.write_text("ham\thello\neggs\tbacon\n", encoding="utf-8")
    with pytest.raises(ValueError, match="eggs"):
        spam.read_collection(bad)
    with pytest.raises(FileNotFoundError, match="dvc repro download"):
        spam.read_collection(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="dvc repro tokenize"):
        spam.SpamDataset(tmp_path, "train")
    collection = shared_data / "sms_spam_collection" / "SMSSpamCollection"
    with pytest.raises(ValueError, match="the train split has 0 rows"):
        spam.prepare(collection, tmp_path, tokenizer, seed=1, train_frac=0.0001, val_frac=0.1)


# --------------------------------------------------------------------------- #
# The stage
# --------------------------------------------------------------------------- #


def test_stage_counts_and_mlflow_run(prepared: Path, shared_data: Path) -> None:
    assert not (prepared / "reports" / "tokenize" / "metrics.json").exists()  # counts are no metrics
    metrics = json.loads((prepared / "reports" / "tokenize" / "counts.json").read_text())
    assert metrics["verdict"]["train"]["chars"] + metrics["verdict"]["val"]["chars"] == 20_479
    assert metrics["verdict"]["train"]["tokens"] + metrics["verdict"]["val"]["tokens"] >= 5_145
    assert metrics["spam"]["raw"] == {"rows": 5_572, "ham": 4_825, "spam": 747}
    assert metrics["spam"]["max_length"] == 120
    assert [metrics["spam"][s]["rows"] for s in ("train", "val", "test")] == [1_045, 149, 300]
    assert sum(metrics["spam"][s]["spam"] for s in ("train", "val", "test")) == 747
    assert sum(metrics["spam"][s]["ham"] for s in ("train", "val", "test")) == 747
    assert metrics["spam"]["train"]["truncated"] == 0
    assert [metrics["instruct"][s]["records"] for s in ("train", "val", "test")] == [935, 55, 110]

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{prepared / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("gptlab").experiment_id], "attributes.run_name = 'tokenize'"
    )
    assert runs
    for run in runs:  # the determinism test may have added a second, identical run
        assert run.info.status == "FINISHED"
        # Counts are params, not metrics; only MLflow's system sampling (every 10 s of a slow run) may add some.
        assert not [name for name in run.data.metrics if not name.startswith("system/")]
        assert run.data.params["counts.spam.max_length"] == "120"
        assert run.data.params["counts.instruct.train.records"] == "935"
        assert run.data.params["tokenize.spam.seed"] == "123"
        # Its inputs: the three raw datasets, each with DVC's md5 and its split sizes.
        inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
        assert set(inputs) == {"verdict", "spam", "instruct"}
        spam_input = inputs["spam"]
        collection = shared_data / "sms_spam_collection" / "SMSSpamCollection"
        assert spam_input.dataset.digest == hashlib.md5(collection.read_bytes()).hexdigest()
        assert json.loads(spam_input.dataset.profile) == {
            "train_rows": 1_045,
            "val_rows": 149,
            "test_rows": 300,
        }
        assert {t.key: t.value for t in spam_input.tags}["mlflow.data.context"] == "source"
        assert json.loads(inputs["instruct"].dataset.profile) == {
            "train_records": 935,
            "val_records": 55,
            "test_records": 110,
        }


def test_stage_is_deterministic(prepared: Path, tmp_path: Path, shared_data: Path) -> None:
    again = run_stage(tmp_path, shared_data, prepared / "mlflow.db")
    assert processed_files(again) == processed_files(prepared / "data" / "processed")
    assert (tmp_path / "reports" / "tokenize" / "counts.json").read_bytes() == (
        prepared / "reports" / "tokenize" / "counts.json"
    ).read_bytes()


def test_stage_refuses_missing_inputs_before_any_work(tmp_path: Path, shared_data: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "gpt2").mkdir(parents=True)
    for name in ("vocab.bpe", "encoder.json"):
        (raw / "gpt2" / name).write_bytes((shared_data / "gpt2" / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"the-verdict\.txt.*SMSSpamCollection.*dvc repro download"):
        run_stage(tmp_path, raw, tmp_path / "mlflow.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def _pickled(path: Path) -> None:
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)


def _truncated(path: Path) -> None:
    np.save(path, np.arange(200, dtype=np.int32).reshape(2, 100))
    path.write_bytes(path.read_bytes()[:-50])


def _not_npy(path: Path) -> None:
    path.write_bytes(b"just some text, not an array\n")


def _floats(path: Path) -> None:
    np.save(path, np.ones((2, 4), dtype=np.float32))


def _out_of_vocabulary(path: Path) -> None:
    np.save(path, np.array([[15496, 995, 50257, 0], [1, 2, 3, 50256]], dtype=np.int32))


def _negative(path: Path) -> None:
    np.save(path, np.array([[15496, 995, -1, 0], [1, 2, 3, 50256]], dtype=np.int32))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_pickled, "pickled"),
        (_truncated, "truncated"),
        (_not_npy, "not a NumPy"),
        (_floats, "integer"),
        (
            _out_of_vocabulary,
            r"token id 50257 at index \(0, 2\) is outside GPT-2's vocabulary \(0 to 50256\)",
        ),
        (_negative, r"token id -1 at index \(0, 2\) is outside GPT-2's vocabulary"),
    ],
    ids=["pickled", "truncated", "not-npy", "floats", "out-of-vocabulary", "negative"],
)
@pytest.mark.parametrize("dataset", ["verdict", "spam"])
def test_damaged_npy_names_the_file(
    tmp_path: Path, damage: Callable[[Path], None], message: str, dataset: str
) -> None:
    processed = tmp_path / "processed"
    if dataset == "verdict":
        path = verdict.split_path(processed, "train")
        path.parent.mkdir(parents=True)
        damage(path)
        load = lambda: verdict.load_split(processed, "train")  # noqa: E731
    else:
        csv_path, path = spam.split_paths(processed, "train")
        path.parent.mkdir(parents=True)
        csv_path.write_text("text,label\nhello,0\nwin now,1\n")
        damage(path)
        load = lambda: spam.SpamDataset(processed, "train")  # noqa: E731
    before = snapshot(tmp_path)
    with pytest.raises(GptlabError, match=message) as info:
        load()
    assert str(path) in str(info.value)
    assert snapshot(tmp_path) == before
