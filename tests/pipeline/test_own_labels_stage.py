"""spam-finetune on your own labelled file: three classes, their metrics, and answers in their names.

One tiny run, in-process (a 2-layer GPT, 3 epochs over the worked example's 23 training
tickets), shared by the tests of this module; the model is logged, so the served pyfunc
model is checked too, loaded in-process as `mlflow models serve` loads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score

from gptlab.cli.main import main as gptlab_main
from gptlab.data import spam
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.tokenizer import load_tokenizer
from gptlab.pipeline.params import load_params
from gptlab.tasks.classifier import class_logits, classify_texts

from helpers import PROJECT_ROOT, committed_params_raw, copy_code, copy_empty_store

CLASSES = ("billing", "bug", "feature")
SPLITS = ("train", "val", "test")
TICKETS = ["I was charged twice this month, please refund me", "The app crashes when I open settings"]


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory, shared_data: Path, empty_store: Path
) -> tuple[Path, str]:
    """A copy of the project whose spam-finetune stage ran on examples/own-data/labels.csv, and its
    MLflow store's URI."""
    import mlflow

    from stages import spam_finetune

    project = tmp_path_factory.mktemp("own-labels") / "project"
    copy_code(project)
    (project / "data" / "own").mkdir(parents=True)
    shutil.copy(
        PROJECT_ROOT / "examples" / "own-data" / "labels.csv", project / "data" / "own" / "labels.csv"
    )
    params = committed_params_raw()
    params["tokenize"]["spam"].update(file="data/own/labels.csv", format="csv", train_frac=0.6, val_frac=0.2)
    params["tracking"].update(system_metrics=False)
    params["spam"].update(trainable="all", drop_rate=0.0)
    params["spam"]["train"].update(epochs=3, lr=1e-2, eval_freq=2, eval_iter=1, device="cpu")
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / "data" / "raw").mkdir(parents=True)
    (project / "data" / "raw" / "gpt2").symlink_to(shared_data / "gpt2", target_is_directory=True)
    loaded = load_params(project / "params.yaml")
    split = loaded.tokenize.spam
    spam.prepare(
        project / split.file,
        project / loaded.data.processed_dir,
        load_tokenizer(shared_data),
        seed=split.seed,
        train_frac=split.train_frac,
        val_frac=split.val_frac,
        own=spam.OwnFile("csv", split.text_column, split.label_column, split.labels),
    )
    torch.manual_seed(0)
    base = ModelConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=True)
    save_model(build_gpt(base), project / "models" / "gpt2" / "gpt2-small", {"source": "pretrain"})
    store = tmp_path_factory.mktemp("own-labels-mlflow")
    copy_empty_store(empty_store, store / "mlflow.db")
    uri = f"sqlite:///{store}/mlflow.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        try:
            spam_finetune.run(load_params())
        finally:
            mlflow.set_tracking_uri(None)  # the stage set it globally: the tests' own stores again
    return project, uri


@pytest.mark.slow
def test_three_classes_get_their_metrics_matrix_and_names(trained: tuple[Path, str]) -> None:
    trained, _ = trained
    reports = trained / "reports" / "spam"
    metrics = json.loads((reports / "metrics.json").read_text())
    counts = json.loads((reports / "counts.json").read_text())
    predictions = pd.read_csv(reports / "predictions.csv")
    test = pd.read_csv(trained / "data" / "processed" / "spam" / "test.csv")
    assert predictions["actual"].tolist() == [CLASSES[i] for i in test["label"]]
    assert set(predictions["predicted"]) <= set(CLASSES)

    # The stage's test scores are scikit-learn's on the stage's own test predictions.
    actual, predicted = predictions["actual"], predictions["predicted"]
    scores = metrics["test"]
    assert set(scores) == {"accuracy", "macro_precision", "macro_recall", "macro_f1", "classes"}
    assert scores["accuracy"] == pytest.approx((actual == predicted).mean())
    for name, score in (("precision", precision_score), ("recall", recall_score), ("f1", f1_score)):
        each = score(actual, predicted, labels=list(CLASSES), average=None, zero_division=0.0)
        assert [scores["classes"][c][name] for c in CLASSES] == pytest.approx(each.tolist())
        assert scores[f"macro_{name}"] == pytest.approx(float(np.mean(each)))
    # The N x N confusion matrix, rows actual, columns predicted, by name.
    matrix = counts["confusion_matrix"]["test"]
    assert set(matrix) == {f"actual_{c}" for c in CLASSES}
    cells = [[matrix[f"actual_{a}"][f"predicted_{p}"] for p in CLASSES] for a in CLASSES]
    assert cells == confusion_matrix(actual, predicted, labels=list(CLASSES)).tolist()
    assert (reports / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    model, metadata = load_model(trained / "models" / "spam")
    assert model.cfg.num_classes == 3
    assert metadata["labels"] == {"0": "billing", "1": "bug", "2": "feature"}
    headline = ("accuracy", "macro_precision", "macro_recall", "macro_f1")
    assert metadata["metrics"]["test"] == {name: scores[name] for name in headline}


@pytest.mark.slow
def test_classify_and_the_served_model_answer_with_the_class_names(
    trained: tuple[Path, str],
    shared_data: Path,
    tokenizer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow.pyfunc

    trained, uri = trained
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    model, metadata = load_model(trained / "models" / "spam")
    probs = classify_texts(model, tokenizer, TICKETS, max_length=metadata["max_length"])
    expected = [CLASSES[int(i)] for i in probs.argmax(axis=1)]
    with torch.no_grad():  # the same answer the checkpoint gives read directly
        ids = torch.from_numpy(spam.pad_ids(spam.encode_texts(TICKETS, tokenizer), metadata["max_length"]))
        assert class_logits(model, ids.long()).argmax(dim=-1).tolist() == probs.argmax(axis=1).tolist()

    args = ["classify", "--model", str(trained / "models" / "spam"), "--raw-dir", str(shared_data), "--json"]
    assert gptlab_main([*args, *TICKETS]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["label"] for row in rows] == expected
    assert [row["probability"] for row in rows] == pytest.approx(probs.max(axis=1).tolist(), abs=1e-6)

    served = mlflow.pyfunc.load_model("models:/gptlab-spam/1")
    outputs = [column.name for column in served.metadata.get_output_schema().inputs]
    assert outputs == ["label", "probability"]
    answer = served.predict(pd.DataFrame({"text": TICKETS}))
    assert answer["label"].tolist() == expected
    assert answer["probability"].tolist() == pytest.approx(probs.max(axis=1).tolist(), abs=1e-5)
