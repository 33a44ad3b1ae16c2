"""The download and tokenize stages with corpus.name gutenberg: the books fetched, then streamed into shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data.gutenberg import Book
from gptlab.data.token_shards import read_shard, shard_paths
from gptlab.pipeline.params import load_params
from stages import download, tokenize_data

from helpers import PROJECT_ROOT, committed_params_raw


@pytest.mark.slow
def test_download_then_tokenize_the_first_books(
    shared_data: Path, gutenberg_books: list[Book], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = committed_params_raw()
    corpus = raw["corpus"]
    corpus["name"] = "gutenberg"
    corpus["gutenberg"] |= {"books": str(PROJECT_ROOT / corpus["gutenberg"]["books"]), "books_per_author": 2}
    corpus["gutenberg"]["max_books"] = 3  # of the test books: two by Alcott, one by Alger
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    params = load_params("params.yaml")

    download.run(params)
    books_dir = Path("data/raw") / corpus["gutenberg"]["path"]
    assert sorted(p.name for p in books_dir.iterdir()) == sorted(b.file for b in gutenberg_books[:3])
    tokenize_data.run(params)

    counts = json.loads(Path("reports/tokenize/counts.json").read_text(encoding="utf-8"))
    committed = json.loads((PROJECT_ROOT / "reports/tokenize/counts.json").read_text(encoding="utf-8"))
    assert {name: counts[name] for name in committed} == committed  # the book's datasets as before
    gutenberg = counts["gutenberg"]
    assert (gutenberg["books"], gutenberg["train"]["books"], gutenberg["val"]["books"]) == (3, 2, 1)
    processed = Path("data/processed/gutenberg")
    for split in ("train", "val"):
        assert sum(len(read_shard(p)) for p in shard_paths(processed, split)) == gutenberg[split]["tokens"]
    books = json.loads((processed / "books.json").read_text(encoding="utf-8"))["books"]
    assert [b["file"] for b in books] == [b.file for b in gutenberg_books[:3]]

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id], "attributes.run_name = 'tokenize'")
    assert run.data.params["corpus.name"] == "gutenberg"
    assert run.data.params["counts.gutenberg.books"] == "3"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "tokenize/gutenberg")] == [
        "tokenize/gutenberg/books.json"
    ]
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs if d.dataset.name == "gutenberg"]
    assert json.loads(dataset.profile) == {
        "train_tokens": gutenberg["train"]["tokens"],
        "val_tokens": gutenberg["val"]["tokens"],
    }
