"""The spam-finetune stage end to end through the real `dvc repro`, then `gptlab classify` on its model.

One tiny run (a 2-layer GPT, 4 epochs over 32 messages) is shared by the slow
tests of this module: ~25 s of CPU for the stage and the DVC and MLflow checks.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gptlab.cli.main import main as gptlab_main
from gptlab.data import spam
from gptlab.files import sha256_file
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import WEIGHTS_FILE, load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.tokenizer import load_tokenizer
from gptlab.pipeline.params import load_params
from gptlab.tasks.classifier import PAD_TOKEN_ID, class_logits, make_classifier

from helpers import committed_params_raw, copy_code, copy_empty_store, dvc, git, invoke, served_model

ROWS = 32  # per split: 4 training batches of 8
EPOCHS = 4
SPLITS = ("train", "val", "test")
# DVC draws the confusion matrix from predictions.csv; the book's PNG of it is a plain output.
SPAM_PLOTS = ("losses.csv", "accuracy.csv", "predictions.csv")


def write_params(project: Path) -> None:
    """The committed params.yaml, shrunk to a run of seconds that still learns something."""
    params = committed_params_raw()
    params["tokenize"]["spam"]["max_rows"] = ROWS
    # A tiny random model learns from scratch: train all of it, faster, without dropout.
    params["spam"].update(trainable="all", drop_rate=0.0)
    params["spam"]["train"].update(epochs=EPOCHS, lr=1e-2, eval_freq=4, eval_iter=1, device="cpu")
    params["checkpoints"]["every_steps"] = 100
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory, shared_data: Path, empty_store: Path
) -> tuple[Path, dict[str, str]]:
    """A copy of the project with a tiny base model and spam slice, after `dvc repro spam-finetune`."""
    project = tmp_path_factory.mktemp("spam") / "project"
    copy_code(project)
    write_params(project)
    # The tokenizer reads data.raw_dir/gpt2: point it at the mirror's BPE files.
    (project / "data" / "raw").mkdir(parents=True)
    (project / "data" / "raw" / "gpt2").symlink_to(shared_data / "gpt2", target_is_directory=True)
    # The tokenize stage's spam part, as that stage would run it with these params.
    params = load_params(project / "params.yaml")
    split = params.tokenize.spam
    spam.prepare(
        shared_data / params.data.sources.sms_spam.path,
        project / params.data.processed_dir,
        load_tokenizer(shared_data),
        seed=split.seed,
        train_frac=split.train_frac,
        val_frac=split.val_frac,
        max_rows=split.max_rows,
    )
    torch.manual_seed(0)
    base = ModelConfig(context_length=128, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.1, qkv_bias=True)
    # As load-gpt2 writes it with `gpt2.source: pretrain` (the smoke profile): our own model, named gpt2-small.
    pretrained = {"source": "pretrain", "checkpoint": "models/pretrain"}
    save_model(build_gpt(base), project / "models" / "gpt2" / "gpt2-small", pretrained)

    store = tmp_path_factory.mktemp("mlflow")
    copy_empty_store(empty_store, store / "mlflow.db")
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "DVC_SITE_CACHE_DIR": str(tmp_path_factory.mktemp("dvc-site")),
        # The copy's own code, not the editable install's; this interpreter's tools on PATH.
        "PYTHONPATH": str(project / "src"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "OMP_NUM_THREADS": "1",  # a tiny model: threads only add overhead on a shared CPU
        # System metrics every second (default 10 s): the tiny stage ends within seconds.
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
    }
    git(project, "init", "-q")
    dvc(project, "init", "-q", env=env)
    dvc(project, "repro", "--single-item", "spam-finetune", env=env)
    return project, env


@pytest.mark.slow
def test_stage_learns_and_reports_consistent_metrics(trained: tuple[Path, dict[str, str]]) -> None:
    project, _ = trained
    reports = project / "reports" / "spam"
    metrics = json.loads((reports / "metrics.json").read_text())
    counted = json.loads((reports / "counts.json").read_text())

    # Balanced classes: chance is 50 %; training data must be learnt well beyond it.
    assert metrics["train"]["accuracy"] >= 0.75, metrics["train"]
    assert metrics["train"]["accuracy"] > metrics["initial"]["train_accuracy"]
    assert counted["steps"] == EPOCHS * ROWS // 8 and counted["examples_seen"] == EPOCHS * ROWS
    # metrics.json holds only the headline figures; counts and matrix cells live in counts.json.
    assert set(metrics) == {"initial", *SPLITS, "final_train_loss", "final_val_loss"}
    scores = {
        "accuracy",
        "precision",
        "recall",
        "f1",
        "macro_precision",
        "macro_recall",
        "macro_f1",
        "classes",
    }
    assert all(set(metrics[split]) == scores for split in SPLITS)
    assert all(set(metrics[split]["classes"]) == {"ham", "spam"} for split in SPLITS)
    # spam's own scores, as the book reports them, are its entry among the classes'.
    assert all(metrics[s]["classes"]["spam"]["f1"] == metrics[s]["f1"] for s in SPLITS)
    assert not list((project / ".gptlab" / "runs").glob("spam-finetune/*")), "finished runs leave no state"

    for split in SPLITS:
        frame = pd.read_csv(project / "data" / "processed" / "spam" / f"{split}.csv")
        matrix = counted["confusion_matrix"][split]
        counts = np.array(
            [[matrix[f"actual_{a}"][f"predicted_{p}"] for p in ("ham", "spam")] for a in ("ham", "spam")]
        )
        assert counts.sum() == len(frame) == ROWS
        assert counts.sum(axis=1).tolist() == [(frame["label"] == 0).sum(), (frame["label"] == 1).sum()]
        tn, fp, fn, tp = counts.ravel()
        assert metrics[split]["accuracy"] == pytest.approx((tn + tp) / ROWS)
        assert metrics[split]["precision"] == pytest.approx(tp / (tp + fp))
        assert metrics[split]["recall"] == pytest.approx(tp / (tp + fn))

    # predictions.csv is the test confusion matrix, row by row, in test-set order.
    predictions = pd.read_csv(reports / "predictions.csv")
    test = pd.read_csv(project / "data" / "processed" / "spam" / "test.csv")
    assert list(predictions.columns) == ["actual", "predicted"]
    assert predictions["actual"].tolist() == test["label"].map({0: "ham", 1: "spam"}).tolist()
    table = pd.crosstab(predictions["actual"], predictions["predicted"])
    assert table.loc["spam", "spam"] == counted["confusion_matrix"]["test"]["actual_spam"]["predicted_spam"]

    losses = pd.read_csv(reports / "losses.csv")
    assert list(losses.columns) == ["step", "examples_seen", "train_loss", "val_loss"]
    assert losses["step"].tolist() == list(range(0, counted["steps"], 4))
    assert losses["examples_seen"].tolist() == [8 * (s + 1) for s in losses["step"]]
    accuracy = pd.read_csv(reports / "accuracy.csv")
    assert accuracy["epoch"].tolist() == list(range(EPOCHS + 1))  # 0: before training
    assert accuracy["train_accuracy"].iloc[0] == metrics["initial"]["train_accuracy"]
    assert (reports / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The checkpoint rebuilds the classifier alone, with what `gptlab classify` needs.
    model, metadata = load_model(project / "models" / "spam")
    assert model.cfg.num_classes == 2 and model.out_head.out_features == 2
    assert metadata["labels"] == {"0": "ham", "1": "spam"}
    # The book's scores, as before the per-class ones: a retrain writes the same checkpoint bytes.
    assert all(set(metadata["metrics"][s]) == {"accuracy", "precision", "recall", "f1"} for s in SPLITS)
    assert metadata["max_length"] == np.load(project / "data" / "processed" / "spam" / "train.npy").shape[1]
    assert metadata["pooling"] == "last" and metadata["base_model"] == "gpt2-small"


@pytest.mark.slow
def test_dvc_sees_the_declared_metrics_and_plots(trained: tuple[Path, dict[str, str]]) -> None:
    project, env = trained
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["spam-finetune"]
    assert {out["path"] for out in lock["outs"]} >= {
        "models/spam",
        "reports/spam/metrics.json",
        "reports/spam/counts.json",
    }
    shown = json.loads(dvc(project, "metrics", "show", "--json", env=env).stdout)
    data = next(iter(shown.values()))["data"]["reports/spam/metrics.json"]["data"]
    assert (
        data["test"]["accuracy"]
        == json.loads((project / "reports/spam/metrics.json").read_text())["test"]["accuracy"]
    )
    plots = json.loads(dvc(project, "plots", "show", "--json", "--split", env=env).stdout)
    # Other stages' plots are missing in this copy; every one of this stage's renders.
    assert not [e for e in plots["errors"] if e["name"].startswith("reports/spam/")], plots["errors"]
    ours = {name: entries for name, entries in plots["data"].items() if name.startswith("reports/spam/")}
    assert set(ours) == {f"reports/spam/{f}" for f in SPAM_PLOTS}
    assert all(entries for entries in ours.values())
    confusion = ours["reports/spam/predictions.csv"][0]["content"]["spec"]["encoding"]
    assert (confusion["x"]["field"], confusion["y"]["field"]) == ("predicted", "actual")
    assert "up to date" in dvc(project, "status", "spam-finetune", env=env).stdout
    # The metric columns `dvc exp show` gets from this stage: headline figures only, no counts.
    assert "confusion_matrix" not in json.dumps(data) and "steps" not in data


@pytest.mark.slow
def test_mlflow_run_holds_metrics_curves_confusion_matrix_and_model(
    trained: tuple[Path, dict[str, str]],
) -> None:
    project, env = trained
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("gptlab")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    run = next(r for r in runs if r.info.run_name == "spam-finetune")
    metrics = json.loads((project / "reports" / "spam" / "metrics.json").read_text())
    assert run.info.status == "FINISHED"
    assert run.data.metrics["spam/test_accuracy"] == pytest.approx(metrics["test"]["accuracy"])
    assert run.data.metrics["spam/test_f1"] == pytest.approx(metrics["test"]["f1"])
    assert run.data.params["spam.trainable"] == "all"
    run_id = run.info.run_id
    assert len(client.get_metric_history(run_id, "spam/curves/val_accuracy")) == EPOCHS
    assert len(client.get_metric_history(run_id, "spam/curves/train_loss")) == len(
        pd.read_csv(project / "reports/spam/losses.csv")
    )
    counted = json.loads((project / "reports" / "spam" / "counts.json").read_text())
    # Final scores at the last step, the fresh head's once at step 0.
    last_step = counted["steps"] - 1
    assert [m.step for m in client.get_metric_history(run_id, "spam/test_accuracy")] == [last_step]
    assert [m.step for m in client.get_metric_history(run_id, "spam/initial_train_accuracy")] == [0]
    # Every metric under the stage's prefix (no chart of the UI mixes stages), system use apart.
    sections = sorted({name.split("/")[0] for name in run.data.metrics if "/" in name})
    assert sections == ["spam", "system"] and all("/" in m for m in run.data.metrics)
    curves = {name for name in run.data.metrics if name.startswith("spam/curves/")}
    assert curves == {
        f"spam/curves/{m}"
        for m in ("train_loss", "val_loss", "train_accuracy", "val_accuracy", "examples_seen")
    }
    assert all(len(client.get_metric_history(run_id, name)) > 1 for name in curves)
    assert float(run.data.tags["gptlab.wall_seconds"]) > 0 and "wall_seconds" not in run.data.metrics
    assert run.data.tags["gptlab.steps"] == str(counted["steps"])
    artifacts = {a.path for folder in ("spam", "spam/reports") for a in client.list_artifacts(run_id, folder)}
    assert {
        "spam/confusion_matrix.png",
        "spam/confusion_matrix_test.json",
        "spam/reports/metrics.json",
        "spam/reports/counts.json",
    } <= artifacts
    # The book's figures, each uploaded once; a constant lr is a param, not a curve.
    assert sorted(a for a in artifacts if a.endswith(".png")) == [
        "spam/accuracy.png",
        "spam/confusion_matrix.png",
        "spam/loss.png",
    ]
    assert "spam/curves/lr" not in run.data.metrics and run.data.params["spam.train.lr"] == "0.01"
    # Standard MLflow tags, system metrics, the data it read, and where its base model came from.
    assert run.data.tags["mlflow.source.name"].endswith("spam_finetune.py") and run.data.tags["mlflow.user"]
    assert any(name.startswith("system/") for name in run.data.metrics)
    (data_input,) = client.get_run(run_id).inputs.dataset_inputs
    assert data_input.dataset.name == "spam"
    assert json.loads(data_input.dataset.profile) == {f"{split}_rows": ROWS for split in SPLITS}
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["spam-finetune"]
    locked = next(dep for dep in lock["deps"] if dep["path"] == "data/processed/spam")
    assert data_input.dataset.digest == locked["md5"]  # DVC's own hash of the folder
    assert run.data.tags["gptlab.upstream_checkpoint"] == "models/gpt2/gpt2-small"
    assert "written by no run" in run.data.tags["mlflow.note.content"]  # the test's base model
    assert run.data.tags["gptlab.checkpoint_sha256"] == sha256_file(
        project / "models" / "spam" / WEIGHTS_FILE
    )
    # The checkpoint is the run's logged model (its one copy in MLflow), registered as gptlab-spam.
    assert not any(path.startswith("spam/model") for path in artifacts)
    (version,) = client.search_model_versions("name = 'gptlab-spam'")
    assert version.run_id == run_id and run.data.tags["gptlab.registered_model"] == "gptlab-spam/1"
    # The base model named as what it is: this pipeline's own tiny model, not OpenAI's gpt2-small.
    base = "gpt2-small (this pipeline's pretrain checkpoint models/pretrain: 2 layers, 32-dim embeddings"
    assert run.data.tags["gptlab.base_model"].startswith(base)
    assert f"Base model: {base}" in version.description
    # Nested under its pipeline run (the one `dvc repro`), which holds its headline figures and loss figure.
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["gptlab.role"] == "pipeline" and parent.info.status == "FINISHED"
    assert parent.data.metrics["spam/test_accuracy"] == pytest.approx(metrics["test"]["accuracy"])
    assert "spam_loss.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    logged = json.loads(
        Path(client.download_artifacts(run_id, "spam/confusion_matrix_test.json")).read_text()
    )
    matrix = counted["confusion_matrix"]["test"]
    assert logged["matrix"] == [
        [matrix[f"actual_{a}"][f"predicted_{p}"] for p in ("ham", "spam")] for a in ("ham", "spam")
    ]


@pytest.mark.slow
def test_classify_agrees_with_the_stage_on_the_test_set(
    trained: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project, _ = trained
    monkeypatch.chdir(project)
    test = pd.read_csv(project / "data" / "processed" / "spam" / "test.csv")
    predictions = pd.read_csv(project / "reports" / "spam" / "predictions.csv")
    # Messages are one per line; none of the sliced test messages spans lines.
    assert not test["text"].str.contains("\n").any()
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(test["text"]) + "\n\n"))
    assert gptlab_main(["classify", "--file", "-", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == test["text"].tolist()
    assert [r["label"] for r in rows] == predictions["predicted"].tolist()
    assert all(0.5 <= r["probability"] <= 1.0 for r in rows)


@pytest.mark.slow
def test_classify_prints_label_probability_and_text(
    trained: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project, _ = trained
    monkeypatch.chdir(project)
    messages = [
        "You are a winner! Claim your free prize now",
        "Hey, just wanted to check if we're still on for dinner?",
    ]
    (project / "messages.txt").write_text(messages[1] + "\n")
    assert gptlab_main(["classify", messages[0], "--file", "messages.txt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, message in zip(lines, messages, strict=True):
        label, probability, text = line.split("\t")
        assert label in ("ham", "spam") and 0.5 <= float(probability) <= 1.0 and text == message


def test_classify_without_a_trained_model_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert gptlab_main(["classify", "free prize"]) == 2
    err = capsys.readouterr().err
    assert "no trained classifier in models/spam" in err and "dvc repro spam-finetune" in err
    assert "gptlab smoke" not in err  # no smoke run to point at


def test_classify_after_a_smoke_run_names_the_command_that_uses_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    save_model(
        build_gpt(ModelConfig(context_length=16, emb_dim=16, n_heads=2, n_layers=1)),
        ".gptlab/smoke/models/spam",
    )
    assert gptlab_main(["classify", "free prize"]) == 2
    err = capsys.readouterr().err
    assert "gptlab classify --model .gptlab/smoke/models/spam --raw-dir .gptlab/smoke/data/raw" in err


def test_classify_refuses_a_language_model_checkpoint(
    tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = ModelConfig(context_length=16, emb_dim=16, n_heads=2, n_layers=1)
    save_model(build_gpt(cfg), tmp_path / "lm")
    code = gptlab_main(["classify", "hi", "--model", str(tmp_path / "lm"), "--raw-dir", str(shared_data)])
    assert code == 2
    assert "not a spam-finetune classifier" in capsys.readouterr().err


def test_classify_pads_like_training_and_uses_the_checkpoint_pooling(
    tmp_path: Path, shared_data: Path, tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(context_length=32, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
    model = make_classifier(build_gpt(cfg), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    metadata = {"labels": {"0": "ham", "1": "spam"}, "max_length": 12, "pooling": "mean"}
    save_model(model, tmp_path / "clf", metadata)
    args = ["classify", "--model", str(tmp_path / "clf"), "--raw-dir", str(shared_data), "--json"]
    message = "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121"

    assert gptlab_main([*args, message, "ok see you"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = torch.from_numpy(spam.pad_ids(spam.encode_texts([message, "ok see you"], tokenizer), 12)).long()
    assert ids[1, -1] == PAD_TOKEN_ID and ids[0, -1] != PAD_TOKEN_ID  # one padded, one truncated
    with torch.no_grad():
        probs = torch.softmax(class_logits(model, ids, "mean"), dim=-1)
    for row, p in zip(rows, probs, strict=True):
        best = int(p.argmax())
        assert row["label"] == ("ham", "spam")[best]
        assert row["probability"] == pytest.approx(float(p[best]), abs=1e-6)

    assert gptlab_main(args) == 2
    assert "nothing to classify" in capsys.readouterr().err
    assert gptlab_main([*args, "hello", " "]) == 2
    assert "message 2 is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_registered_model_serves_over_http(trained: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """`mlflow models serve` on the stage's registered model labels a spam and a ham message as the stage did."""
    project, env = trained
    test = pd.read_csv(project / "data" / "processed" / "spam" / "test.csv")
    predictions = pd.read_csv(project / "reports" / "spam" / "predictions.csv")
    right = (
        test["text"][predictions["actual"] == predictions["predicted"]].groupby(predictions["actual"]).first()
    )
    assert set(right.index) == {"ham", "spam"}, "the stage got no spam or no ham test message right"
    messages, labels = [right["spam"], right["ham"]], ["spam", "ham"]

    served_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    with served_model("models:/gptlab-spam/1", tmp_path, served_env) as url:
        status, answer = invoke(
            url, {"dataframe_split": {"columns": ["text"], "data": [[m] for m in messages]}}
        )
    assert status == 200, answer
    rows = answer["predictions"]
    assert [row["label"] for row in rows] == labels
    assert rows[0]["spam_probability"] > 0.5 > rows[1]["spam_probability"]


@pytest.mark.slow
def test_lora_stage_trains_the_adapters_then_saves_a_plain_classifier(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """spam.trainable lora (appendix E), in-process: adapters counted and trained, the model saved merged."""
    from gptlab.model.lora import add_lora
    from gptlab.tasks.classifier import count_trainable
    from stages import spam_finetune

    project = tmp_path / "project"
    copy_code(project)
    params = committed_params_raw()
    params["tokenize"]["spam"]["max_rows"] = 16
    params["tracking"].update(system_metrics=False, log_models=False)
    params["spam"].update(
        trainable="lora", lora={"rank": 4, "alpha": 8}, max_length="context", pooling="first"
    )
    params["spam"]["train"].update(epochs=2, lr=1e-2, eval_freq=2, eval_iter=1, device="cpu")
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / "data" / "raw").mkdir(parents=True)
    (project / "data" / "raw" / "gpt2").symlink_to(shared_data / "gpt2", target_is_directory=True)
    loaded = load_params(project / "params.yaml")
    spam.prepare(
        shared_data / loaded.data.sources.sms_spam.path,
        project / loaded.data.processed_dir,
        load_tokenizer(shared_data),
        seed=loaded.tokenize.spam.seed,
        train_frac=loaded.tokenize.spam.train_frac,
        val_frac=loaded.tokenize.spam.val_frac,
        max_rows=16,
    )
    torch.manual_seed(0)
    base = ModelConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0, qkv_bias=True)
    # As load-gpt2 writes it with `gpt2.source: pretrain` (the smoke profile): our own model, named gpt2-small.
    pretrained = {"source": "pretrain", "checkpoint": "models/pretrain"}
    save_model(build_gpt(base), project / "models" / "gpt2" / "gpt2-small", pretrained)
    with torch.device("meta"):
        expected = make_classifier(build_gpt(base), 2, trainable="lora", trainable_blocks=1, seed=0)
        expected = count_trainable(add_lora(expected, 4, 8))
    monkeypatch.chdir(project)

    spam_finetune.run(load_params())

    out = capsys.readouterr().out
    # Named as what it is: our own model, not the GPT-2 its folder is named after.
    base_named = (
        "gpt2-small (this pipeline's pretrain checkpoint models/pretrain: 2 layers, 32-dim embeddings"
    )
    assert f"{base_named}, 2 heads, context 64): {expected:,} of " in out and "(LoRA rank 4, alpha 8)" in out
    counted = json.loads((project / "reports" / "spam" / "counts.json").read_text())
    assert counted["trainable_params"] == expected
    # Saved merged: a plain classifier with GPT-2's tensor names, padded to the model's context.
    model, metadata = load_model(project / "models" / "spam")
    assert not any(".lora." in name for name in model.state_dict())
    assert metadata["trainable"] == "lora" and metadata["lora"] == {"rank": 4, "alpha": 8.0, "merged": True}
    assert metadata["trainable_params"] == expected
    assert metadata["max_length"] == 64 and metadata["pooling"] == "first"
    # The adapters trained: the merged head differs from the seeded fresh head the stage started with.
    fresh = make_classifier(build_gpt(base), 2, trainable="lora", trainable_blocks=1, seed=123)
    assert not torch.allclose(model.out_head.weight, fresh.out_head.weight)
    base_model, _ = load_model(project / "models" / "gpt2" / "gpt2-small")
    assert torch.equal(model.tok_emb.weight, base_model.tok_emb.weight)  # no Linear, no adapter: frozen
    # The saved model reproduces the stage's test predictions.
    test = spam.SpamDataset(project / "data" / "processed", "test")
    test.reencode(load_tokenizer(shared_data), 64)
    with torch.no_grad():
        predicted = class_logits(model, test.input_ids, "first").argmax(dim=-1)
    written = pd.read_csv(project / "reports" / "spam" / "predictions.csv")["predicted"]
    assert written.tolist() == [("ham", "spam")[i] for i in predicted.tolist()]
    run = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name("gptlab").experiment_id],
        filter_string="tags.`gptlab.stage` = 'spam-finetune'",
    )[0]
    assert (
        run.data.tags["gptlab.trainable_params"] == str(expected)
        and float(run.data.tags["gptlab.wall_seconds"]) > 0
    )
    # tracking.log_models false: the stage logs and registers no model (DVC alone keeps the checkpoint).
    assert "gptlab.model_uri" not in run.data.tags and MlflowClient().search_registered_models() == []
