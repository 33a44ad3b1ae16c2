"""One store per project: a command run anywhere inside the project, the smoke workspace and DVC's
temporary experiment copies included, logs to the project's mlflow.db unless MLFLOW_TRACKING_URI says otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlflow
import pytest

from gptlab.experiments.smoke import prepare_workspace
from gptlab.paths import project_root
from gptlab.tracking.store import tracking_uri

from helpers import commit_as_fresh_clone, copy_project, dvc, git


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A committed project holding only its pipeline file: enough to be one."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n", encoding="utf-8")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_every_folder_of_the_project_resolves_to_its_root(project: Path, tmp_path: Path) -> None:
    inside = [project, project / "src" / "gptlab", project / ".dvc" / "tmp" / "exps" / "tmp1a2b"]
    workspace = project / ".gptlab" / "smoke"
    prepare_workspace(project, workspace, {})
    for folder in [*inside, workspace, workspace / "reports", workspace / ".dvc" / "tmp" / "exps" / "tmp9"]:
        folder.mkdir(parents=True, exist_ok=True)
        assert project_root(folder) == project, folder
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert project_root(outside) == outside


def test_a_workspace_outside_the_project_logs_to_the_projects_store(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = tmp_path / "ws"  # `gptlab smoke --workdir` anywhere
    prepare_workspace(project, workspace, {})
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(workspace)
    assert tracking_uri() == f"sqlite:///{project / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")  # the user's choice wins
    assert tracking_uri() == "http://mlflow.example:5000"


@pytest.mark.slow
def test_a_dvc_experiment_in_the_smoke_workspace_lands_in_the_projects_store(
    tmp_path: Path, shared_data: Path
) -> None:
    project = tmp_path / "project"
    copy_project(project)
    commit_as_fresh_clone(project)
    workspace = project / ".gptlab" / "smoke"
    prepare_workspace(project, workspace, {})
    env = {key: value for key, value in os.environ.items() if key != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workspace / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])

    dvc(workspace, "exp", "run", "--name", "my-try", "download", env=env)

    assert not (workspace / "mlflow.db").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gptlab")
    (run,) = client.search_runs([experiment.experiment_id], "tags.`gptlab.stage` = 'download'")
    assert run.data.tags["gptlab.stage"] == "download" and run.data.tags["gptlab.dvc_exp"] == "my-try"
    assert run.info.status == "FINISHED"
    assert Path(experiment.artifact_location.removeprefix("file://")) == project / "mlruns"
