"""`gptlab ui`: the MLflow UI on the project's store, at the experiment's training runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gptlab.cli.main import main
from gptlab.tracking.runs import stage_run


def test_the_url_opens_the_experiments_runs_in_the_model_training_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["ui", "--experiment", "exp-ui", "--print-url"]) == 0
    assert "no experiment 'exp-ui' yet" in capsys.readouterr().out
    with stage_run("pretrain", "exp-ui", {}) as run:
        experiment_id = run.client.get_run(run.run_id).info.experiment_id
    assert main(["ui", "--experiment", "exp-ui", "--print-url", "--port", "5123"]) == 0
    url = (
        f"http://127.0.0.1:5123/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        "&viewStateShareKey=gptlab"  # the runs table's columns, stored in the experiment by its first run
    )
    assert capsys.readouterr().out.strip().endswith(url)
    tags = run.client.get_experiment(experiment_id).tags
    assert "metrics.`final/val_loss`" in json.loads(tags["mlflow.sharedViewState.gptlab"])["selectedColumns"]


@pytest.mark.slow
def test_it_serves_the_projects_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with stage_run("pretrain", "exp-ui", {}) as run:
        experiment_id = run.client.get_run(run.run_id).info.experiment_id
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gptlab = str(Path(sys.executable).with_name("gptlab"))
    server = subprocess.Popen(
        [gptlab, "ui", "--experiment", "exp-ui", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the server's workers too, to stop them all
    )
    try:
        assert f"/#/experiments/{experiment_id}/runs" in server.stdout.readline()
        api = f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get?experiment_id={experiment_id}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(api, timeout=5) as answer:
                    experiment = json.load(answer)["experiment"]
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the UI did not come up"
                time.sleep(0.5)
        assert experiment["name"] == "exp-ui"
        tags = {tag["key"]: tag["value"] for tag in experiment["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
