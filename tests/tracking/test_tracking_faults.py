"""Tracking servers that fail (issue 23, cases 6 and 7), against real servers in subprocesses.

A URI that answers HTTP but is not MLflow is refused in one line before a stage starts. An MLflow
server killed mid-training does not stop it: the logging is kept and sent when the server is back
before the stage ends; otherwise the stage fails in one line naming the URI and the resume folder,
which keeps the trained state, so the rerun trains nothing again and logs a complete run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from torch import nn

from gptlab.cli.main import main
from gptlab.data.verdict import GPTDatasetV1
from gptlab.experiments.profiles import dvc_executable
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import list_checkpoints
from gptlab.model.config import ModelConfig
from gptlab.pipeline.training_stage import DatasetRead, training_run
from gptlab.tracking.runs import rerun_command
from gptlab.tracking.store import TrackingLost
from gptlab.training.loop import TrainResult
from gptlab.training.losses import next_token_loss

from helpers import (
    MlflowServer,
    checkpoint_config,
    committed_params,
    committed_params_text,
    dvc,
    free_port,
    git,
    train_config,
    wait_for,
)

TINY = ModelConfig(vocab_size=300, context_length=8, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
# 3 epochs of 5 steps, an evaluation every 2 steps and a checkpoint at every epoch's end.
LOOP = train_config(batch_size=4, epochs=3, lr=5e-3, eval_freq=2, eval_iter=1, rng="book")
CHECKPOINTS = checkpoint_config(every_steps=1000, keep=1)


@pytest.mark.slow
def test_a_server_that_is_not_mlflow_is_one_line_naming_the_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    http_server = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        uri = f"http://127.0.0.1:{port}"
        wait_for(uri, http_server)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        (tmp_path / "reports").mkdir()
        out = tmp_path / "REPRODUCTION.md"
        assert main(["report", "--reports", str(tmp_path / "reports"), "--out", str(out), "--log"]) == 2
    finally:
        http_server.kill()
        http_server.wait()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"MLFLOW_TRACKING_URI {uri} answers, but not as an MLflow tracking server" in err
    assert "HTTP 404" in err


def windows(n: int, seed: int) -> GPTDatasetV1:
    ids = torch.randint(
        0, TINY.vocab_size, (n * TINY.context_length + 1,), generator=torch.Generator().manual_seed(seed)
    )
    return GPTDatasetV1(ids.tolist(), TINY.context_length, TINY.context_length)


def train(
    tmp_path: Path,
    name: str,
    on_epoch_end: Callable[[int, nn.Module], dict] | None,
    *,
    system_metrics: bool = False,
) -> TrainResult:
    """A training stage as the real ones run: its MLflow run and resume folder, the shared loop."""
    params = committed_params()
    tracking = dataclasses.replace(params.tracking, system_metrics=system_metrics)
    params = dataclasses.replace(params, tracking=tracking)
    data = tmp_path / "data.txt"
    data.write_text("toy")
    torch.manual_seed(0)
    with training_run(
        name,
        params,
        logged={"toy": 1},
        fingerprint={"toy": name},
        inputs=[data],
        dataset=DatasetRead("toy", data, {"train_rows": 22}),
    ) as stage:
        result = stage.fit(
            build_gpt(TINY), windows(22, 1), windows(5, 2), LOOP, next_token_loss, on_epoch_end=on_epoch_end
        )
        stage.tracker.log_metrics({"final/steps": result.steps}, step=result.global_step)
        return result


def runs_of(uri: str, name: str, experiment_name: str | None = None) -> list:
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name or committed_params().tracking.experiment)
    return client.search_runs([experiment.experiment_id], filter_string=f"tags.`gptlab.stage` = '{name}'")


@pytest.mark.slow
def test_a_server_killed_mid_training_and_back_before_its_end_gets_the_whole_run(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    def kill_then_restart(epoch: int, model: nn.Module) -> dict:
        if epoch == 1:
            server.kill()
        if epoch == 2:
            server.start()
        return {}

    result = train(tmp_path, "toy-back", kill_then_restart)
    err = capsys.readouterr().err
    assert err.count(f"MLflow tracking server {server.uri} stopped answering") == 1, err
    assert f"MLflow tracking server {server.uri} answers again" in err
    (run,) = runs_of(server.uri, "toy-back")
    assert run.info.status == "FINISHED"
    client = MlflowClient(tracking_uri=server.uri)
    logged = client.get_metric_history(run.info.run_id, "toy-back/curves/train_loss")
    assert sorted(m.step for m in logged) == [int(row["step"]) for row in result.history]
    assert run.data.metrics["final/steps"] == 15
    assert list((tmp_path / ".gptlab" / "runs" / "toy-back").iterdir()) == []  # published: nothing to resume


@pytest.mark.slow
def test_a_server_killed_mid_training_for_good_fails_the_stage_keeping_what_trained(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    def kill(epoch: int, model: nn.Module) -> dict:
        if epoch == 1:
            server.kill()
        return {}

    with pytest.raises(TrackingLost) as lost:
        train(tmp_path, "toy-lost", kill)
    message = str(lost.value)
    (run_dir,) = [p for p in (tmp_path / ".gptlab" / "runs" / "toy-lost").iterdir() if p.is_dir()]
    assert "\n" not in message and server.uri in message and str(run_dir.relative_to(tmp_path)) in message
    (kept,) = list_checkpoints(run_dir)  # the trained state, after the last step
    assert kept.name == "step-0000015"
    assert "Traceback" not in capsys.readouterr().err

    server.start()
    rerun = train(tmp_path, "toy-lost", None)
    assert rerun.resumed_steps == 15  # nothing trained again
    finished = [r for r in runs_of(server.uri, "toy-lost") if r.info.status == "FINISHED"]
    assert len(finished) == 1
    logged = MlflowClient(tracking_uri=server.uri).get_metric_history(
        finished[0].info.run_id, "toy-lost/curves/train_loss"
    )
    assert sorted(m.step for m in logged) == [int(row["step"]) for row in rerun.history]


@pytest.mark.slow
def test_a_server_killed_for_good_ends_the_stage_within_the_tracking_timeout(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the last epoch: what follows is only tracking (the last logging, the wait for the
    server, the run's end, the system metrics thread), bounded by GPTLAB_TRACKING_TIMEOUT (3 s here)
    plus a margin for the work itself, wide enough for a loaded machine. With MLflow's retries and
    backoff it took minutes."""
    monkeypatch.chdir(tmp_path)
    killed: list[float] = []

    def kill_after_the_last_epoch(epoch: int, model: nn.Module) -> dict:
        if epoch == LOOP.epochs:
            server.kill()
            killed.append(time.monotonic())
        return {}

    with pytest.raises(TrackingLost) as lost:
        train(tmp_path, "toy-timeout", kill_after_the_last_epoch, system_metrics=True)
    waited = time.monotonic() - killed[0]
    assert "waited 3 s" in str(lost.value) and "\n" not in str(lost.value)
    assert waited < 3 + 20, f"the stage failed {waited:.1f} s after the server died"


# A training stage as the real ones run (stage_main, training_run, publish, its model registered), tiny.
# With KILL_SERVER set, it kills the tracking server's process group after its first epoch.
TOY_STAGE = """\
import dataclasses, os, signal
from pathlib import Path
import torch
from gptlab.data.verdict import GPTDatasetV1
from gptlab.experiments.profiles import dvc_executable
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.pipeline.stage import stage_main
from gptlab.pipeline.training_stage import DatasetRead, Reports, loss_table, training_run
from gptlab.training.losses import next_token_loss

CFG = ModelConfig(context_length=8, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)


def windows(n, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (n * CFG.context_length + 1,), generator=generator)
    return GPTDatasetV1(ids.tolist(), CFG.context_length, CFG.context_length)


def run(params):
    loop = dataclasses.replace(
        params.pretrain.train, device="cpu", batch_size=4, epochs=3, lr=5e-3, eval_freq=2, eval_iter=1
    )

    def kill_the_server(epoch, model):
        if epoch == 1 and os.environ.get("KILL_SERVER"):
            os.killpg(int(os.environ["KILL_SERVER"]), signal.SIGKILL)
        return {}

    data = Path("toy.txt")
    torch.manual_seed(0)
    dataset = DatasetRead("toy", data, {"train_rows": 22})
    with training_run("toy", params, logged={"toy": 1}, fingerprint={"toy": 1}, inputs=[data], dataset=dataset) as stage:
        model = build_gpt(CFG)
        result = stage.fit(model, windows(22, 1), windows(5, 2), loop, next_token_loss, on_epoch_end=kill_the_server)
        losses = loss_table(result.history, ["step", "train_loss", "val_loss"])
        reports = Reports(Path("reports/toy"), {"steps": result.steps}, {"train_rows": 22}, losses)
        reports.folder.mkdir(parents=True, exist_ok=True)
        stage.publish(model, Path("models/toy"), {"stage": "toy"}, reports, result, kind="pretrain", model_defaults={})


stage_main(run, "a toy training stage")
"""


@pytest.mark.slow
def test_a_stage_whose_server_was_lost_for_good_is_completed_by_the_command_its_error_names(
    tmp_path: Path, server: MlflowServer, shared_data: Path
) -> None:
    """Row 81: the line said "rerun the stage once the server answers", but `dvc repro` then found the
    outputs written and skipped it: the runs stayed RUNNING and no model was registered. The line now
    names the command; run once the server is back, it trains nothing again and registers the model once."""
    project = tmp_path / "project"
    project.mkdir()
    params = yaml.safe_load(committed_params_text())
    params["tracking"].update(experiment="lost-for-good", system_metrics=False)
    (project / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    data = committed_params().data
    for bpe in data.bpe_files():  # the registered model carries GPT-2's BPE files
        (project / bpe).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared_data / bpe.relative_to(data.raw_dir), project / bpe)
    (project / "toy_stage.py").write_text(TOY_STAGE, encoding="utf-8")
    (project / "toy.txt").write_text("toy", encoding="utf-8")
    stage = {
        "cmd": f"{sys.executable} toy_stage.py",
        "deps": ["toy_stage.py", "toy.txt"],
        "outs": ["models/toy"],
    }
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"toy": stage}}), encoding="utf-8")
    git(project, "init", "-q")
    dvc(project, "init", "-q")

    env = {**os.environ, "KILL_SERVER": str(server.process.pid)}
    lost = subprocess.run(
        [dvc_executable(), "repro"], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )
    assert lost.returncode != 0 and not server.running
    said = [
        line
        for line in (lost.stdout + lost.stderr).splitlines()
        if "stopped answering during the run" in line
    ]
    assert len(said) == 1, lost.stdout + lost.stderr
    command = re.search(r"run `([^`]+)`", said[0])
    assert command is not None, said[0]
    assert command.group(1) == "dvc repro -f -s toy"

    server.start()
    program, *args = shlex.split(command.group(1))
    assert program == "dvc"
    rerun = subprocess.run(
        [dvc_executable(), *args], cwd=project, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr[-3000:]
    client = MlflowClient(tracking_uri=server.uri)
    (version,) = client.search_model_versions("name = 'lost-for-good-pretrain'")
    runs = {run.info.status: run for run in runs_of(server.uri, "toy", "lost-for-good")}
    assert sorted(runs) == ["FINISHED", "KILLED"]
    assert version.run_id == runs["FINISHED"].info.run_id
    assert runs["FINISHED"].data.metrics["toy/steps"] == 15


def test_the_rerun_named_goes_to_the_smoke_workspace_first_and_a_stage_run_alone_reruns_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    workspace = project / ".gptlab" / "smoke"
    workspace.mkdir(parents=True)
    for folder in (project, workspace):
        (folder / "dvc.yaml").write_text("stages: {}\n", encoding="utf-8")
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("GPTLAB_PIPELINE_RUN", "smoke-20261207-1200-abc")  # as `gptlab smoke` sets it
    assert rerun_command("eval").startswith(f"`cd {workspace} && dvc repro -f -s eval` (forced: ")
    monkeypatch.chdir(project)
    assert rerun_command("eval").startswith("`dvc repro -f -s eval` (forced: ")
    monkeypatch.delenv("GPTLAB_PIPELINE_RUN")
    monkeypatch.setattr(sys, "argv", ["stages/eval.py", "--params", "my params.yaml"])
    assert rerun_command("eval") == "`python stages/eval.py --params 'my params.yaml'`"
