"""MLflow tracking in a real local store: run naming, tags, params, metric histories, artifacts."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

from gptlab.data.verdict import GPTDatasetV1
from gptlab.errors import GptlabError
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.schema import flatten
from gptlab.tracking.buffered_run import NULL_RUN
from gptlab.tracking.lineage import dvc_md5, pipeline_run_id
from gptlab.tracking.runs import run_title, stage_run
from gptlab.tracking.store import tracking_uri
from gptlab.training.config import TrainConfig
from gptlab.training.loop import fit
from gptlab.training.losses import next_token_loss

from helpers import checkpoint_config, committed_params, train_config


def client() -> MlflowClient:
    return MlflowClient(tracking_uri())


def runs_of(experiment: str) -> list:
    found = client().get_experiment_by_name(experiment)
    return client().search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def test_tracking_uri_defaults_to_sqlite_in_the_project(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_stage_run_logs_params_tags_and_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTLAB_PIPELINE_RUN", "repro-42")
    monkeypatch.setenv("DVC_EXP_NAME", "tiny-lr")
    params = flatten(committed_params().pretrain, "pretrain")
    with stage_run("pretrain", "exp-a", params) as run:
        run.log_metrics({"val_loss": 6.5}, step=3)
    with pytest.raises(RuntimeError, match="boom"), stage_run("eval", "exp-a", {"eval.batch_size": 2}):
        raise RuntimeError("boom")

    parent, first, second = runs_of("exp-a")  # the pipeline run "repro-42", then its two stages
    assert parent.data.tags["gptlab.role"] == "pipeline" and parent.info.status == "FAILED"
    # Named by stage and DVC experiment, so the compare view tells the runs of one stage apart.
    assert (first.info.run_name, first.info.status) == ("pretrain · tiny-lr", "FINISHED")
    assert (second.info.run_name, second.info.status) == ("eval · tiny-lr", "FAILED")
    assert first.data.params["pretrain.train.lr"] == "0.0004"
    assert first.data.params["pretrain.train.max_steps"] == "null"
    assert len(first.data.params) == len(params)
    tags = first.data.tags
    assert tags["gptlab.stage"] == "pretrain" and tags["gptlab.dvc_exp"] == "tiny-lr"
    # Both stages of one `dvc repro` share the pipeline-run tag, so they can be found together.
    assert tags["gptlab.pipeline_run"] == second.data.tags["gptlab.pipeline_run"] == "repro-42"
    assert len(tags["gptlab.params_hash"]) == 16 and tags["gptlab.git_dirty"] in ("true", "false")
    assert tags["mlflow.source.git.commit"]
    assert first.data.metrics == {"val_loss": 6.5}


def test_a_run_is_named_by_its_stage_and_its_variant_or_experiment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    assert run_title("pretrain") == "pretrain"  # a plain `dvc repro`
    monkeypatch.setenv("DVC_EXP_NAME", "smoke-20261204-121500")
    assert run_title("pretrain") == "pretrain · smoke-20261204-121500"
    assert run_title("spam-finetune", "lora-r16") == "spam-finetune · lora-r16"  # the sweep's variant wins


def test_pipeline_run_id_outside_dvc_is_unique(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPTLAB_PIPELINE_RUN", raising=False)
    first, second = pipeline_run_id(), pipeline_run_id()
    assert first.startswith("single-") and first != second


def test_a_rank_other_than_0_gets_the_disabled_run_which_logs_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, isolated_tools: str
) -> None:
    """Under torchrun only rank 0 logs: the others' tracker touches no store and reads no file."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    missing = tmp_path / "missing"  # any method that read it would raise
    store = Path(isolated_tools.removeprefix("sqlite:///"))
    untouched = store.read_bytes()  # the test's empty store: any run, experiment or tag would change it
    with stage_run("pretrain", "exp-rank-1", {"pretrain.seed": 1}) as run:
        assert run is NULL_RUN and run.run_id is None
        run.log_metrics({"val_loss": 6.5}, step=3)
        run.log_history([{"step": 1, "train_loss": 7.0}])
        run.log_params({"seed": 1})
        run.set_tags({"gptlab.steps": 3})
        run.log_text("text", "a.txt")
        run.log_dict({"a": 1}, "a.json")
        run.log_figure(Figure(), "a.png")
        run.log_table({"a": [1]}, "a_table.json")
        run.log_artifact(missing)
        run.log_reports(missing, "reports")
        run.log_input("verdict", missing, context="training")
        run.record_checkpoint(missing)
        run.link_upstream(missing, {"stage": "pretrain"})
    assert store.read_bytes() == untouched


def test_artifacts_land_in_the_store(tmp_path: Path) -> None:
    report = tmp_path / "reports"
    report.mkdir()
    (report / "metrics.json").write_text("{}")
    fig = Figure()
    fig.add_subplot().plot([0, 1], [1, 0])
    with stage_run("pretrain", "exp-b", {}) as run:
        run.log_text("Every effort moves you", "pretrain/samples.txt")
        run.log_figure(fig, "pretrain/loss.png")
        run.log_artifact(report, "pretrain/reports")
        run.log_dict({"a": 1}, "eval/samples.json")
        run_id = run.run_id
    listed = {a.path for a in client().list_artifacts(run_id, "pretrain")}
    assert listed == {"pretrain/samples.txt", "pretrain/loss.png", "pretrain/reports"}
    assert [a.path for a in client().list_artifacts(run_id, "pretrain/reports")] == [
        "pretrain/reports/metrics.json"
    ]
    text = Path(client().download_artifacts(run_id, "pretrain/samples.txt", str(tmp_path)))
    assert text.read_text() == "Every effort moves you"


@pytest.mark.slow
def test_fit_logs_its_metric_history_and_relogs_it_after_a_resume(tmp_path: Path, tokenizer) -> None:
    ids = tokenizer.encode("Every effort moves you " * 60)
    train_data, val_data = GPTDatasetV1(ids[:200], 8, 8), GPTDatasetV1(ids[200:300], 8, 8)
    cfg = train_config(
        batch_size=4, epochs=2, lr=1e-3, eval_freq=2, eval_iter=1, seed=1, rng="per_epoch", grad_clip=1.0
    )
    model_cfg = ModelConfig(context_length=8, emb_dim=16, n_heads=2, n_layers=1)

    def train(run, train_cfg: TrainConfig):
        torch.manual_seed(0)
        return fit(
            build_gpt(model_cfg),
            train_data,
            val_data,
            cfg=train_cfg,
            checkpoints=checkpoint_config(every_steps=3, keep=1),
            loss_fn=next_token_loss,
            run_dir=tmp_path,
            tracker=run,
            on_epoch_end=lambda epoch, model: {"epoch_score": float(epoch), "note": "text is not a metric"},
        )

    with stage_run("pretrain", "exp-c", {}) as run:
        full = train(run, cfg)
        first_id = run.run_id
    steps = [row["step"] for row in full.history]
    history = client().get_metric_history(first_id, "pretrain/curves/train_loss")
    assert [(m.step, m.value) for m in history] == [(row["step"], row["train_loss"]) for row in full.history]
    assert [m.value for m in client().get_metric_history(first_id, "pretrain/curves/tokens_seen")] == [
        row["tokens_seen"] for row in full.history
    ]
    assert not client().get_metric_history(first_id, "pretrain/curves/lr")  # constant: a param, no curve
    assert [
        (m.step, m.value) for m in client().get_metric_history(first_id, "pretrain/curves/epoch_score")
    ] == [(row["step"], row["epoch_score"]) for row in full.epochs]
    assert "note" not in client().get_run(first_id).data.metrics

    # A finished run's checkpoint is still there: a new stage execution "resumes" at the end and
    # must still show the whole curve in its own MLflow run.
    with stage_run("pretrain", "exp-c", {}) as run:
        resumed = train(run, cfg)
        second_id = run.run_id
    assert resumed.resumed_steps == full.steps and resumed.history == full.history
    assert client().get_run(second_id).data.tags["gptlab.resumed_from_step"] == str(full.steps)
    assert [m.step for m in client().get_metric_history(second_id, "pretrain/curves/val_loss")] == steps

    # A warm-up and a schedule vary the lr: then it is a curve.
    scheduled = dataclasses.replace(cfg, warmup_steps=2, lr_schedule="cosine", min_lr=1e-4)
    with stage_run("pretrain", "exp-c", {}) as run:
        torch.manual_seed(0)
        varied = fit(
            build_gpt(model_cfg),
            train_data,
            val_data,
            cfg=scheduled,
            checkpoints=checkpoint_config(every_steps=3, keep=1),
            loss_fn=next_token_loss,
            run_dir=tmp_path / "scheduled",
            tracker=run,
        )
    logged = [m.value for m in client().get_metric_history(run.run_id, "pretrain/curves/lr")]
    assert logged == pytest.approx([row["lr"] for row in varied.history]) and len(set(logged)) > 2


def test_an_unreachable_server_fails_fast_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        started = time.monotonic()
        with pytest.raises(GptlabError, match=f"MLflow tracking server {uri} is unreachable"):  # noqa: SIM117
            with stage_run("pretrain", "exp-unreachable", {}):
                pytest.fail("the stage ran although its tracking server is down")
    assert time.monotonic() - started < 30


def test_a_run_left_running_by_a_killed_stage_is_marked_killed_by_the_next() -> None:
    with stage_run("eval", "exp-killed", {}) as run:
        dead_id = run.run_id
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    client().set_terminated(dead_id, status="RUNNING")  # as a SIGKILL leaves it
    client().set_tag(dead_id, "gptlab.pid", dead.stdout.strip())  # a process that has exited
    with stage_run("eval", "exp-killed", {}) as run:
        assert client().get_run(dead_id).info.status == "KILLED"
        alive_id = run.run_id
    assert client().get_run(alive_id).info.status == "FINISHED"


def test_runs_are_started_by_mlflow_with_its_standard_tags_and_system_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    with stage_run("pretrain", "exp-system", {}) as run:
        time.sleep(1.0)
        with_metrics = run.run_id
    with stage_run("pretrain", "exp-system", {}, system_metrics=False) as run:
        time.sleep(0.5)
        without = run.run_id
    first, second = client().get_run(with_metrics), client().get_run(without)
    for found in (first, second):
        assert found.info.status == "FINISHED"
        assert found.data.tags["mlflow.user"] and found.data.tags["mlflow.source.name"]
        assert found.data.tags["mlflow.source.type"] == "LOCAL"
    # psutil is there: CPU and memory use of the machine while the stage ran.
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(
        first.data.metrics
    )
    assert not [name for name in second.data.metrics if name.startswith("system/")]


def test_an_interrupted_run_ends_killed() -> None:
    with pytest.raises(KeyboardInterrupt), stage_run("eval", "exp-interrupt", {}) as run:
        run_id = run.run_id
        raise KeyboardInterrupt
    assert client().get_run(run_id).info.status == "KILLED"


def test_a_source_commit_given_by_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTLAB_SOURCE_COMMIT", "0123abcd" * 5)
    monkeypatch.setenv("GPTLAB_SOURCE_DIRTY", "true")
    with stage_run("eval", "exp-commit", {}) as run:
        run_id = run.run_id
    tags = client().get_run(run_id).data.tags
    assert tags["mlflow.source.git.commit"] == "0123abcd" * 5 and tags["gptlab.git_dirty"] == "true"


def test_log_input_records_the_dvc_hash_and_split_sizes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "train.npy").write_bytes(b"\x00\x01" * 100)
    (data / "sub" / "val.json").write_text('{"a": 1}\n')
    # DVC's own hash of the folder, from `dvc add` in a scratch repository.
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True, env=_dvc_env())
    subprocess.run(["dvc", "add", "-q", "data"], cwd=tmp_path, check=True, env=_dvc_env())
    locked = yaml.safe_load((tmp_path / "data.dvc").read_text())["outs"][0]["md5"]
    assert dvc_md5(data) == locked and locked.endswith(".dir")
    assert dvc_md5(data / "train.npy") == hashlib.md5(b"\x00\x01" * 100).hexdigest()

    with stage_run("spam-finetune", "exp-inputs", {}) as run:
        run.log_input("spam", data, context="training", profile={"train_rows": 3, "val_rows": 1})
        run_id = run.run_id
    (found,) = client().get_run(run_id).inputs.dataset_inputs
    assert (found.dataset.name, found.dataset.digest) == ("spam", locked)
    assert json.loads(found.dataset.profile) == {"train_rows": 3, "val_rows": 1}
    assert json.loads(found.dataset.source)["uri"] == data.resolve().as_uri()
    assert {t.key: t.value for t in found.tags} == {
        "mlflow.data.context": "training",
        "gptlab.path": str(data),
    }


def test_own_data_is_an_input_of_the_stage_and_of_the_pipeline_run_with_dvc_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = tmp_path / "instructions.jsonl"
    own.write_text('{"instruction": "Say hi.", "output": "Hi."}\n', encoding="utf-8")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True, env=_dvc_env())
    subprocess.run(["dvc", "add", "-q", own.name], cwd=tmp_path, check=True, env=_dvc_env())
    locked = yaml.safe_load((tmp_path / "instructions.jsonl.dvc").read_text())["outs"][0]["md5"]
    monkeypatch.setenv("GPTLAB_PIPELINE_RUN", "own-data-pipeline")
    # Two stages of one pipeline run: the parent names the dataset once, the stage that read it has it.
    for stage in ("tokenize", "instruct-finetune"):
        with stage_run(stage, "exp-own", {}) as run:
            if stage == "tokenize":
                run.log_own_data("instruct", own, profile={"train_records": 1})
                reader = run.run_id
            parent = run.parent_id
    tag = {"gptlab.data.instruct": f"{own.as_posix()} ({locked})"}
    for run_id in (reader, parent):
        got = client().get_run(run_id)
        (found,) = got.inputs.dataset_inputs
        assert (found.dataset.name, found.dataset.digest) == ("instruct", locked)
        assert {t.key: t.value for t in found.tags}["mlflow.data.context"] == "own"
        assert json.loads(found.dataset.profile) == {"train_records": 1}
        assert tag.items() <= got.data.tags.items()
    other = [r for r in runs_of("exp-own") if r.info.run_name.startswith("instruct")]
    assert other and not other[0].inputs.dataset_inputs and "gptlab.data.instruct" not in other[0].data.tags


def test_a_dataset_logged_meanwhile_by_a_parallel_stage_is_linked_not_a_failure(tmp_path: Path) -> None:
    """Two variants of a sweep (two DVC queue workers) log the same dataset at once. MLflow looks for
    it, then inserts it: the second insert breaks the store's unique (experiment, name, digest).
    Here the other stage's insert lands between this one's look-up and insert, as it did in a sweep."""
    from mlflow.store.tracking.dbmodels.models import SqlDataset
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    data = tmp_path / "data.txt"
    data.write_text("toy")
    db = tracking_uri().removeprefix("sqlite:///")
    raced: list[str] = []

    def the_other_stage_inserts_it_first(session: Session, *_: object) -> None:
        pending = [row for row in session.new if isinstance(row, SqlDataset)]
        if pending and not raced:
            row = pending[0]
            raced.append(row.name)
            with contextlib.closing(sqlite3.connect(db)) as other, other:
                other.execute(
                    "INSERT INTO datasets (dataset_uuid, experiment_id, name, digest, dataset_source_type,"
                    " dataset_source) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        uuid.uuid4().hex,
                        row.experiment_id,
                        row.name,
                        row.digest,
                        row.dataset_source_type,
                        row.dataset_source,
                    ),
                )

    event.listen(Session, "before_flush", the_other_stage_inserts_it_first)
    try:
        with stage_run("spam-finetune", "exp-race", {}) as run:
            run.log_input("spam", data, context="training")
    finally:
        event.remove(Session, "before_flush", the_other_stage_inserts_it_first)
    assert raced == ["spam"]
    (found,) = client().get_run(run.run_id).inputs.dataset_inputs
    assert (found.dataset.name, found.dataset.digest) == ("spam", dvc_md5(data))


def test_link_upstream_finds_the_writer_by_its_weights_and_links_it(checkpoint: Path) -> None:
    with stage_run("pretrain", "exp-lineage", {}) as upstream:
        upstream.record_checkpoint(checkpoint)
        upstream_id = upstream.run_id
    experiment_id = client().get_run(upstream_id).info.experiment_id
    with stage_run("eval", "exp-other", {}) as run:  # another experiment: found all the same
        run.link_upstream(checkpoint, {"stage": "pretrain"})
        run_id = run.run_id
    tags = client().get_run(run_id).data.tags
    assert tags["gptlab.upstream_run_id"] == upstream_id
    assert tags["gptlab.upstream_stage"] == "pretrain"
    assert tags["gptlab.upstream_checkpoint"] == checkpoint.as_posix()
    assert (
        f"[pretrain](#/experiments/{experiment_id}/runs/{upstream_id}?workflowType=machine_learning)"
        in tags["mlflow.note.content"]
    )


def _dvc_env() -> dict[str, str]:
    return {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}


def test_every_experiment_is_tagged_for_model_training_and_an_old_one_gets_the_tag() -> None:
    old = client().create_experiment("exp-untagged")  # as stores made before the tag hold them
    assert "mlflow.experimentKind" not in client().get_experiment(old).tags
    for name in ("exp-untagged", "exp-new"):
        with stage_run("pretrain", name, {}):
            pass
        kind = client().get_experiment_by_name(name).tags.get("mlflow.experimentKind")
        assert kind == "custom_model_development", name  # the MLflow UI's "Model training" mode
