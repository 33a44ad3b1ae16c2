"""The real `dvc repro` of download + tokenize in a fresh copy of the project, offline with the mirror."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from helpers import (
    PROJECT_ROOT,
    commit_as_fresh_clone,
    committed_params,
    copy_project,
    dvc,
    dvc_exp_show,
    gutenberg_inputs,
    project_env,
)

STAGES = ("download", "tokenize")
REPORT = "reports/tokenize/counts.json"


def snapshot(project: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every output file and of dvc.lock."""
    files = [project / "dvc.lock", *(p for d in ("data", "reports") for p in (project / d).rglob("*"))]
    return {
        str(p.relative_to(project)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in files
        if p.is_file()
    }


def pipeline_runs(
    uri: str, experiment_name: str = "gptlab", role: str = "stage"
) -> list[mlflow.entities.Run]:
    """The stages' runs of the experiment (role `pipeline`: the pipeline runs' own)."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return [r for r in runs if r.data.tags.get("gptlab.role", "stage") == role]


@pytest.mark.slow
def test_repro_download_tokenize_then_noop(tmp_path: Path, shared_data: Path, isolated_tools: str) -> None:
    project = tmp_path / "project"
    copy_project(project)
    commit_as_fresh_clone(project)
    env = project_env(project)
    assert env["GPTLAB_MIRROR"] == str(shared_data)

    dvc(project, "repro", *STAGES, env=env)

    params = yaml.safe_load((project / "params.yaml").read_text())
    raw = project / params["data"]["raw_dir"]
    for source in params["data"]["sources"].values():
        path = raw / source["path"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == source["sha256"], path
    processed = project / params["data"]["processed_dir"]
    expected = {
        *(f"verdict/{s}.npy" for s in ("train", "val")),
        *(f"spam/{s}.{ext}" for s in ("train", "val", "test") for ext in ("csv", "npy")),
        *(f"{data}/{s}.json" for data in ("instruct", "preference") for s in ("train", "val", "test")),
    }
    assert {str(p.relative_to(processed)) for p in processed.rglob("*") if p.is_file()} == expected
    metrics = json.loads((project / REPORT).read_text())
    assert [metrics["spam"][s]["rows"] for s in ("train", "val", "test")] == [1_045, 149, 300]
    assert metrics["spam"]["max_length"] == 120
    assert [metrics["instruct"][s]["records"] for s in ("train", "val", "test")] == [935, 55, 110]
    # The committed reference run's lock comes with the clone; the stages run here are (re)locked.
    locked = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(STAGES) <= set(locked)
    assert {out["path"] for out in locked["download"]["outs"]} == {params["data"]["raw_dir"]}
    # Counts are a plain report, not DVC metrics: they add no `dvc exp show` columns.
    shown = json.loads(dvc(project, "metrics", "show", "--json", env=env).stdout)
    assert "reports/tokenize" not in json.dumps(shown)

    runs = pipeline_runs(isolated_tools)
    assert sorted(r.info.run_name for r in runs) == sorted(STAGES)
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert len({r.data.tags["gptlab.pipeline_run"] for r in runs}) == 1, "one dvc repro, one pipeline id"
    (parent,) = pipeline_runs(isolated_tools, role="pipeline")  # one MLflow run for the dvc repro
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent.info.run_id}
    assert (parent.info.run_name, parent.info.status) == ("pipeline", "FINISHED")

    before = snapshot(project)
    second = dvc(project, "repro", *STAGES, env=env)
    assert snapshot(project) == before
    for stage in STAGES:
        assert f"'{stage}' didn't change" in second.stdout, second.stdout
    assert len(pipeline_runs(isolated_tools)) == len(STAGES), "a no-op repro runs no stage"


def quiet_as_smoke(proc: subprocess.CompletedProcess[str], log: Path, stages: list[str]) -> None:
    """`gptlab run` prints what `gptlab smoke` does: a line per stage, the headline metrics, the next
    steps; the stages' own output (DVC's warnings, JSON counts, progress bars) goes to its log."""
    lines = proc.stdout.splitlines()
    assert len(lines) <= 40 and proc.stderr == "", proc.stdout + proc.stderr
    started = [line.split()[1] for line in lines if line.startswith("[")]
    assert started == stages, proc.stdout
    assert "No file hash info" not in proc.stdout and '"rows"' not in proc.stdout
    headline = lines[lines.index(next(line for line in lines if "Headline metrics:" in line)) + 1]
    assert headline.split()[0] == "pretrain" and "final_val_loss" in headline, proc.stdout
    assert "Next:" in lines and any("dvc exp apply" in line for line in lines)
    assert "Running stage 'pretrain'" in log.read_text(encoding="utf-8")


@pytest.mark.slow
def test_gptlab_run_gutenberg_smoke_is_an_experiment_beside_the_workspace_pretrained_on_the_corpus(
    tmp_path: Path, shared_data: Path, isolated_tools: str
) -> None:
    """The gutenberg-smoke profile as users run it, through pretrain: a DVC experiment run in a temporary
    copy, logged to the profile's own MLflow experiment; its books from the mirror, shards, a token budget."""
    from gptlab.data.gutenberg import corpus_books
    from gptlab.experiments.profiles import profile_params

    profile = PROJECT_ROOT / "profiles" / "gutenberg-smoke.yaml"
    params = profile_params(profile, PROJECT_ROOT / "params.yaml")
    gutenberg = params.corpus.gutenberg
    gutenberg_inputs(corpus_books(dataclasses.replace(gutenberg, books=str(PROJECT_ROOT / gutenberg.books))))
    project = tmp_path / "project"
    copy_project(project)
    commit_as_fresh_clone(project)
    params_before = (project / "params.yaml").read_bytes()
    env = project_env(project)
    gptlab = Path(sys.executable).with_name("gptlab")
    proc = subprocess.run(
        [str(gptlab), "run", "--profile", "gutenberg-smoke", "--name", "gutenberg-check", "pretrain"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stages = ["download", "tokenize", "pretrain"]
    quiet_as_smoke(proc, project / ".gptlab" / "logs" / "gutenberg-check.log", stages)

    shown = json.loads(dvc_exp_show(project, "--json", env=env))
    names = {exp["name"] for row in shown for exp in (row.get("experiments") or []) if exp.get("name")}
    assert "gutenberg-check" in names
    # The experiment ran in a temporary copy: the workspace's params and outputs are untouched.
    assert (project / "params.yaml").read_bytes() == params_before
    assert not (project / "reports" / "pretrain").exists()
    # The profile logs to its own experiment (`tracking.experiment`), not the real runs'.
    assert not pipeline_runs(isolated_tools)
    (run,) = [
        r
        for r in pipeline_runs(isolated_tools, "gptlab-gutenberg-smoke")
        if r.data.tags.get("gptlab.stage") == "pretrain"
    ]
    assert run.data.tags.get("gptlab.dvc_exp") == "gutenberg-check"
    assert run.data.params["pretrain.model.emb_dim"] == str(params.pretrain.model.emb_dim)  # the profile's
    assert params.pretrain.model.emb_dim != committed_params().pretrain.model.emb_dim
    assert run.data.tags["gptlab.tokens_seen"] == str(params.pretrain.train.max_tokens)
    assert run.data.tags["gptlab.steps"] == "40"
    (dataset,) = run.inputs.dataset_inputs
    profile_of = json.loads(dataset.dataset.profile)
    assert dataset.dataset.name == "gutenberg" and profile_of["books"] == gutenberg.max_books
    assert run.data.metrics["pretrain/final_val_loss"] < run.data.metrics["pretrain/initial_val_loss"]
