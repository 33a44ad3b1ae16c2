"""The pretrain stage on a corpus: token shards in, a token budget, fixed evaluation windows, MLflow's record."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data.token_shards import ShardWriter
from gptlab.model.tokenizer import load_tokenizer
from gptlab.pipeline.params import load_params
from gptlab.tracking.store import tracking_uri
from stages import eval as eval_stage
from stages import pretrain as pretrain_stage

from helpers import committed_params_raw, inputs_dir

LIST_SHA256 = "ab" * 32


def corpus_project(project: Path) -> None:
    """params.yaml on the corpus path (a tiny model, 4 steps of 64 tokens), the BPE files and 2 books' shards."""
    params = committed_params_raw()
    params["corpus"]["name"] = "gutenberg"
    params["tracking"].update(system_metrics=False, log_models=False)
    params["checkpoints"]["every_steps"] = 2
    pretrain = params["pretrain"]
    pretrain["model"].update(context_length=16, emb_dim=32, n_layers=2, n_heads=2)
    pretrain["data"].update(max_length=16, stride=16, eval_windows=4)
    pretrain["train"].update(
        batch_size=2,
        rng="per_epoch",
        eval_freq=2,
        eval_iter=2,
        lr=0.005,
        device="cpu",
        global_batch_tokens=64,  # 2 micro-batches of 2 windows of 16 tokens
        max_tokens=4 * 64,
    )
    pretrain["sample"]["max_new_tokens"] = 3
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    inputs = inputs_dir()
    raw = project / params["data"]["raw_dir"] / "gpt2"
    shutil.copytree(inputs / "gpt2", raw)
    ids = load_tokenizer(inputs).encode((inputs / "the-verdict.txt").read_text(encoding="utf-8"))
    folder = project / params["data"]["processed_dir"] / "gutenberg"
    for prefix, part in (("train", ids[:1000]), ("val", ids[1000:1200])):
        writer = ShardWriter(folder, prefix, shard_tokens=400)
        writer.write(part)
        writer.close()
    books = [{"file": "a.txt", "split": "train"}, {"file": "b.txt", "split": "val"}]
    (folder / "books.json").write_text(json.dumps({"list_sha256": LIST_SHA256, "books": books}))


def test_pretrain_trains_a_token_budget_on_shards_and_eval_scores_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    corpus_project(tmp_path)
    pretrain_stage.run(load_params())

    counts = json.loads((tmp_path / "reports/pretrain/counts.json").read_text())
    assert counts == {"steps": 4, "epochs": 1, "tokens_seen": 4 * 64}
    losses = pd.read_csv(tmp_path / "reports/pretrain/losses.csv")
    assert list(losses.columns) == ["step", "tokens_seen", "train_loss", "val_loss", "val_perplexity"]
    assert list(losses["tokens_seen"]) == [64, 192]
    assert (losses["val_perplexity"] > 1).all()
    metrics = json.loads((tmp_path / "reports/pretrain/metrics.json").read_text())
    assert metrics["final_val_loss"] < metrics["initial_val_loss"]

    client = MlflowClient(tracking_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gptlab").experiment_id])
    (dataset,) = run.inputs.dataset_inputs
    profile = json.loads(dataset.dataset.profile)
    assert dataset.dataset.name == "gutenberg"
    assert profile["books"] == 2 and profile["list_sha256"] == LIST_SHA256
    assert (
        profile["train_windows"] == 24 + 24 + 12 and profile["val_windows"] == 12
    )  # shards of 400, 400, 200
    assert run.data.params["corpus.name"] == "gutenberg"
    assert float(run.data.tags["gptlab.tokens_per_second"]) > 0

    # eval scores the pretrained model on the corpus's fixed samples, not on The Verdict.
    eval_stage.run(load_params())
    scores = json.loads((tmp_path / "reports/eval/metrics.json").read_text())
    assert scores["val_loss"] == pytest.approx(metrics["final_val_loss"], rel=1e-6)  # the same 4 windows
    (evaluation,) = [
        r for r in client.search_runs([run.info.experiment_id]) if r.info.run_id != run.info.run_id
    ]
    assert evaluation.inputs.dataset_inputs[0].dataset.name == "gutenberg"
