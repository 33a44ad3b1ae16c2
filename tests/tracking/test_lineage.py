"""Lineage in MLflow: from an instruct run back to load-gpt2 and pretrain, through checkpoint metadata.

The three stages run in-process on a tiny model (a 2-layer GPT, two optimizer steps of
pretraining, one of instruction tuning) in a tmp project, logging to the test's store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data import instruct, verdict
from gptlab.files import sha256_file
from gptlab.model.checkpoint import WEIGHTS_FILE, read_config
from gptlab.model.tokenizer import load_tokenizer
from gptlab.pipeline.params import load_params
from gptlab.tracking.lineage import dvc_md5
from gptlab.tracking.store import tracking_uri
from stages import instruct_finetune, load_gpt2, pretrain

from helpers import committed_params_raw


def tiny_params(project: Path, shared_data: Path) -> None:
    params = committed_params_raw()
    params["data"]["raw_dir"] = str(shared_data)
    params["tokenize"]["instruct"]["max_records"] = 4
    pre = params["pretrain"]
    pre["model"].update(context_length=128, emb_dim=32, n_layers=2, n_heads=2)
    pre["data"].update(max_length=128, stride=128)
    pre["train"].update(batch_size=8, epochs=1, max_steps=2, eval_freq=1, eval_iter=1, device="cpu")
    pre["sample"]["max_new_tokens"] = 2
    params["gpt2"].update(source="pretrain", batch_size=8)
    params["gpt2"]["sample"]["max_new_tokens"] = 2
    params["spam"]["base_model"] = params["instruct"]["base_model"] = "gpt2-small"
    inst = params["instruct"]
    inst.update(allowed_max_length=128, max_new_tokens=2)
    inst["train"].update(batch_size=2, epochs=1, max_steps=1, eval_freq=1, eval_iter=1, device="cpu")
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
def test_an_instruct_run_leads_back_to_load_gpt2_and_pretrain(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTLAB_PIPELINE_RUN", "repro-lineage")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tiny_params(tmp_path, shared_data)
    params = load_params()
    tokenizer = load_tokenizer(shared_data)
    processed = params.data.processed_dir
    verdict.prepare(
        shared_data / "the-verdict.txt", processed, tokenizer, params.tokenize.verdict.train_ratio
    )
    split = params.tokenize.instruct
    records = instruct.read_splits(split, shared_data / params.data.sources.instruction_data.path)
    instruct.write_splits(records, processed, tokenizer)

    pretrain.run(params)
    load_gpt2.run(params)
    instruct_finetune.run(params)

    # The base is named as what it is, our own 2-layer model, not by its folder's GPT-2 name alone.
    out = capsys.readouterr().out
    assert "gpt2-small (this pipeline's pretrain checkpoint models/pretrain: 2 layers, 32-dim" in out
    assert "\ngpt2-small: " not in out
    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name("gptlab")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"pipeline", "pretrain", "load-gpt2 · pretrain as gpt2-small", "instruct-finetune"}
    # One pipeline run: every stage's run nested under it, which holds each stage's headline figures.
    parent = runs.pop("pipeline")
    assert {r.data.tags["mlflow.parentRunId"] for r in runs.values()} == {parent.info.run_id}
    headline = {name.split("/")[0] for name in parent.data.metrics}
    assert headline == {"pretrain", "load-gpt2", "instruct"} and "instruct/rougeL_f1" in parent.data.metrics
    figures = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert figures == {"pretrain_loss.png", "instruct_loss.png"}
    # Each run is tagged with the weights it wrote (the checkpoints themselves name no run).
    for run_name, checkpoint in (
        ("pretrain", "models/pretrain"),
        ("load-gpt2 · pretrain as gpt2-small", "models/gpt2/gpt2-small"),
        ("instruct-finetune", "models/instruct"),
    ):
        assert runs[run_name].data.tags["gptlab.checkpoint_sha256"] == sha256_file(
            Path(checkpoint) / WEIGHTS_FILE
        )
        assert "mlflow_run_id" not in read_config(checkpoint)[1]

    # Walk the lineage tags from the instruct run to the pretrain run.
    steps = []
    run = runs["instruct-finetune"]
    while "gptlab.upstream_run_id" in run.data.tags:
        tags = run.data.tags
        upstream = client.get_run(tags["gptlab.upstream_run_id"])
        link = f"(#/experiments/{experiment.experiment_id}/runs/{upstream.info.run_id}?workflowType=machine_learning)"
        assert link in tags["mlflow.note.content"]  # the UI's description links the upstream run
        assert tags["gptlab.upstream_stage"] == upstream.data.tags["gptlab.stage"]
        steps.append(upstream.info.run_name)
        run = upstream
    assert steps == ["load-gpt2 · pretrain as gpt2-small", "pretrain"]
    assert (
        runs["load-gpt2 · pretrain as gpt2-small"].data.tags["gptlab.upstream_checkpoint"]
        == "models/pretrain"
    )
    # Runs of one pipeline execution still share its tag.
    assert {r.data.tags["gptlab.pipeline_run"] for r in runs.values()} == {"repro-lineage"}

    # Each run says which data it read: path, DVC hash, split sizes.
    (pretrain_input,) = client.get_run(runs["pretrain"].info.run_id).inputs.dataset_inputs
    assert pretrain_input.dataset.digest == dvc_md5(Path(processed) / "verdict")
    (instruct_input,) = client.get_run(runs["instruct-finetune"].info.run_id).inputs.dataset_inputs
    assert instruct_input.dataset.name == "instruct"
    assert '"train_records": 4' in instruct_input.dataset.profile
