"""A pipeline run as one MLflow run: its stages' runs nested under it, its figures, params and commit on it.

Real stage runs in a real store, from a real git checkout whose params.yaml is changed as
`dvc exp run -S` changes it.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

from gptlab.tracking.buffered_run import stage_metrics
from gptlab.tracking.lineage import effective_params, run_tags
from gptlab.tracking.runs import stage_run
from gptlab.tracking.store import tracking_uri

from helpers import git


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git checkout with params.yaml and some code committed; the working directory."""
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(
            {"pretrain": {"train": {"lr": 0.0004, "epochs": 10}}, "spam": {"trainable": "last_blocks"}}
        )
    )
    (tmp_path / "stage.py").write_text("print('a stage')\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def set_params(checkout: Path, lr: float) -> None:
    """params.yaml as `dvc exp run -S pretrain.train.lr=<lr>` leaves it."""
    params = yaml.safe_load((checkout / "params.yaml").read_text())
    params["pretrain"]["train"]["lr"] = lr
    (checkout / "params.yaml").write_text(yaml.safe_dump(params))


def pipeline(
    experiment: str, name: str, monkeypatch: pytest.MonkeyPatch, *, spam_fails: bool = False
) -> None:
    """Two stages of one DVC experiment `name`, as two processes of one `dvc exp run` would log them."""
    monkeypatch.setenv("GPTLAB_PIPELINE_RUN", f"{name}-1234")
    monkeypatch.setenv("DVC_EXP_NAME", name)
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "a" * 40)
    lr = yaml.safe_load(Path("params.yaml").read_text())["pretrain"]["train"]["lr"]
    with stage_run("pretrain", experiment, {"pretrain.train.lr": lr, "pretrain.train.epochs": 10}) as run:
        run.log_history([{"step": 0, "train_loss": 9.0}, {"step": 5, "train_loss": 7.0}])
        run.log_headline({"final_val_loss": 6.5, "initial_val_loss": 10.9})
        figure = Figure()
        figure.add_subplot().plot([1, 2], [3, 4])
        run.log_figure(figure, "pretrain/loss.png", pipeline=True)
        run.log_figure(figure, "pretrain/other.png")
    failing = pytest.raises(RuntimeError) if spam_fails else contextlib.nullcontext()
    with failing, stage_run("spam-finetune", experiment, {}) as run:
        run.log_history([{"step": 0, "train_loss": 0.7}])
        run.log_values({"train_accuracy": 0.5}, "initial", step=0)
        if spam_fails:
            raise RuntimeError("boom")
        run.log_headline({"test": {"accuracy": 0.9375}, "final_train_loss": 0.1}, step=4)


def test_the_stages_of_a_pipeline_run_nest_under_one_run_holding_its_figures_params_and_commit(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_params(checkout, 0.001)
    pipeline("exp-nest", "lr-b", monkeypatch)
    git(checkout, "checkout", "-q", "params.yaml")
    pipeline("exp-nest", "lr-a", monkeypatch, spam_fails=True)

    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name("exp-nest").experiment_id
    runs = client.search_runs([experiment], order_by=["attributes.start_time ASC"])
    parents = [run for run in runs if run.data.tags.get("gptlab.role") == "pipeline"]
    assert [parent.info.run_name for parent in parents] == ["pipeline · lr-b", "pipeline · lr-a"]
    b, a = parents
    for parent in parents:
        children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(child.data.tags["gptlab.stage"] for child in children) == ["pretrain", "spam-finetune"]
    assert len(runs) == 6  # two parents, each with its two stages' runs: nothing else

    # Each stage's headline figures under its prefix, as metrics.json names them; the loss figure.
    assert b.data.metrics == {
        "pretrain/final_val_loss": 6.5,
        "pretrain/initial_val_loss": 10.9,
        "spam/test_accuracy": 0.9375,
        "spam/final_train_loss": 0.1,
    }
    # The loss figure, at the top of its artifacts: where MLflow's compare view looks for files runs share.
    assert [artifact.path for artifact in client.list_artifacts(b.info.run_id)] == ["pretrain_loss.png"]
    # The whole params.yaml each read (DVC's -S value applied in b): like with like, one param differs.
    assert b.data.params == {
        "pretrain.train.lr": "0.001",
        "pretrain.train.epochs": "10",
        "spam.trainable": "last_blocks",
    }
    assert {key for key, value in a.data.params.items() if b.data.params[key] != value} == {
        "pretrain.train.lr"
    }
    assert set(a.data.params) == set(b.data.params)
    assert b.data.tags["gptlab.dvc_exp"] == "lr-b" and b.data.tags["gptlab.dvc_baseline"] == "a" * 40
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout
    assert b.data.tags["mlflow.source.git.commit"] == head.strip()
    # DVC's -S values are no uncommitted code.
    assert b.data.tags["gptlab.git_dirty"] == "false"
    # A pipeline run ends as its last stage did.
    assert (b.info.status, a.info.status) == ("FINISHED", "FAILED")

    # No chart mixes stages: each stage's runs log names under its own prefix only.
    for run in runs:
        stage = run.data.tags.get("gptlab.stage")
        if stage is not None:
            prefix = {"pretrain": "pretrain/", "spam-finetune": "spam/"}[stage]
            assert all(name.startswith((prefix, "system/")) for name in run.data.metrics), run.data.metrics
    spam = next(
        run
        for run in runs
        if run.data.tags.get("mlflow.parentRunId") == b.info.run_id and "spam" in run.info.run_name
    )
    assert {"spam/curves/train_loss", "spam/initial_train_accuracy", "spam/test_accuracy"} <= set(
        spam.data.metrics
    )


def test_a_stage_run_alone_has_no_parent(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPTLAB_PIPELINE_RUN", raising=False)
    with stage_run("eval", "exp-alone", {}) as run:
        run.log_headline({"val_loss": 6.0})
    client = MlflowClient(tracking_uri())
    (only,) = client.search_runs([client.get_experiment_by_name("exp-alone").experiment_id])
    assert "mlflow.parentRunId" not in only.data.tags and only.data.metrics == {"eval/val_loss": 6.0}


def test_git_dirty_ignores_what_dvc_and_the_pipeline_wrote_but_not_code(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPTLAB_SOURCE_COMMIT", raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    assert run_tags("eval", {})["gptlab.git_dirty"] == "false"
    set_params(checkout, 0.001)
    # Edited by hand outside an experiment: uncommitted, recorded nowhere else.
    assert run_tags("eval", {})["gptlab.git_dirty"] == "true"
    monkeypatch.setenv("DVC_EXP_NAME", "lr-b")  # set by DVC, which applied the change
    assert run_tags("eval", {})["gptlab.git_dirty"] == "false"
    assert effective_params()["pretrain.train.lr"] == 0.001
    (checkout / "stage.py").write_text("print('edited')\n")
    assert run_tags("eval", {})["gptlab.git_dirty"] == "true"


def test_metric_names_are_the_stage_prefix_and_the_metrics_json_names() -> None:
    metrics = {"test": {"accuracy": 0.9}, "final_val_loss": 1.0, "empty": None}
    assert stage_metrics("spam", metrics) == {"spam/test_accuracy": 0.9, "spam/final_val_loss": 1.0}
    assert stage_metrics("pretrain", {"val_loss": 2.0, "initial_train_loss": 3.0}, "initial") == {
        "pretrain/initial_val_loss": 2.0,
        "pretrain/initial_train_loss": 3.0,
    }


def test_effective_params_are_the_whole_file_flat_and_empty_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert effective_params() == {}
    (tmp_path / "params.yaml").write_text("a: {b: 1, c: [1, 2]}\nd: null\n")
    assert effective_params() == {"a.b": 1, "a.c": [1, 2], "d": None}


def test_a_param_written_two_ways_by_two_stages_keeps_the_first(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPTLAB_PIPELINE_RUN", "twice-1")
    with stage_run("pretrain", "exp-twice", {"pretrain.train.lr": 1.0}):
        pass
    with stage_run("eval", "exp-twice", {"pretrain.train.lr": 1}):  # MLflow refuses to change a param
        pass
    client = MlflowClient(tracking_uri())
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("exp-twice").experiment_id], "tags.`gptlab.role` = 'pipeline'"
    )
    assert parent.data.params["pretrain.train.lr"] == "1.0" and parent.info.status == "FINISHED"
