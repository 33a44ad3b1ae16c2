"""The worked example of docs/own-data.md: `gptlab run --profile own-data` through all eight stages on
examples/own-data/, offline; then one edited example file reruns exactly the stages downstream of it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from helpers import PIPELINE_STAGES, commit_as_fresh_clone, copy_project, dvc, project_env

# The example's data, each a dataset of the user's own in MLflow (tokenize's run and the pipeline run's).
OWN_DATA = ("files", "spam", "instruct", "preference")


def gptlab(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = project_env(project)
    command = [str(Path(sys.executable).with_name("gptlab")), *args]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_own_data_profile_runs_every_stage_and_one_edit_reruns_what_follows_it(
    tmp_path: Path, shared_data: Path, isolated_tools: str
) -> None:
    project = tmp_path / "project"
    copy_project(project)
    commit_as_fresh_clone(project)

    proc = gptlab(project, "run", "--profile", "own-data", "--name", "own-check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert len(lines) <= 40, proc.stdout
    assert [re.sub(r"^\[\d/8\] (\S+).*", r"\1", line) for line in lines if line.startswith("[")] == list(
        PIPELINE_STAGES
    )

    client = mlflow.MlflowClient(tracking_uri=isolated_tools)
    experiment = client.get_experiment_by_name("gptlab-own-data")
    runs = client.search_runs([experiment.experiment_id])
    by_stage = {r.data.tags.get("gptlab.stage"): r for r in runs if "gptlab.stage" in r.data.tags}
    assert set(by_stage) == set(PIPELINE_STAGES)
    inputs = by_stage["tokenize"].inputs.dataset_inputs
    own = {d.dataset.name for d in inputs if {t.key: t.value for t in d.tags}["mlflow.data.context"] == "own"}
    assert own == set(OWN_DATA)
    (pipeline,) = [r for r in runs if r.data.tags.get("gptlab.role") == "pipeline"]
    assert {f"gptlab.data.{name}" for name in OWN_DATA} <= set(pipeline.data.tags)
    # The example's three classes, scored per class and on average.
    spam = by_stage["spam-finetune"].data.metrics
    assert {f"spam/test_classes_{name}_f1" for name in ("billing", "bug", "feature")} <= set(spam)
    assert "spam/test_macro_f1" in spam

    # The experiment's params and outputs in the workspace, then one more labelled ticket: tokenize
    # alone sees a changed dependency, and a rerun trains the classifier again and nothing else.
    dvc(project, "exp", "apply", "own-check")
    assert dvc(project, "status").stdout.strip().startswith("Data and pipelines are up to date")
    with (project / "examples" / "own-data" / "labels.csv").open("a", encoding="utf-8") as labels:
        labels.write('"The export button does nothing when I click it.",bug\n')
    status = dvc(project, "status").stdout
    assert re.findall(r"^(\S+):$", status, flags=re.M) == ["tokenize"], status
    rerun = dvc(project, "repro", timeout=600).stdout
    assert re.findall(r"Running stage '([^']+)'", rerun) == ["tokenize", "spam-finetune"], rerun
