"""The pretrain and eval stages end to end through the real `dvc repro`, killed and resumed, on a tiny GPT."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data import spam, verdict
from gptlab.errors import InputError
from gptlab.files import sha256_file
from gptlab.model.checkpoint import WEIGHTS_FILE, list_checkpoints, load_model
from gptlab.pipeline.params import load_params
from gptlab.pipeline.plots import plot_losses
from gptlab.schema import ConfigError
from gptlab.tracking.store import tracking_uri
from stages import pretrain as pretrain_stage

import helpers
from helpers import committed_params_raw, copy_code, git, isolated_environment, sigint_as_in_a_terminal

OUTPUTS = (
    "reports/pretrain/metrics.json",
    "reports/pretrain/counts.json",
    "reports/pretrain/losses.csv",
    "reports/pretrain/loss.png",
    "models/pretrain/model.safetensors",
    "models/pretrain/config.json",
)


def tiny_params(project: Path) -> None:
    """The committed params.yaml shrunk: 2 epochs x 12 steps of a 2-layer model, and few spam/instruct rows."""
    params = committed_params_raw()
    params["tokenize"]["spam"]["max_rows"] = 20
    params["tokenize"]["instruct"]["max_records"] = 5
    pretrain = params["pretrain"]
    pretrain["model"].update(context_length=32, emb_dim=32, n_layers=2, n_heads=2)
    pretrain["data"].update(max_length=32, stride=48)  # 4,612 training tokens: 96 windows, 12 batches
    pretrain["train"].update(batch_size=8, epochs=2, lr=0.005, eval_freq=4, eval_iter=2, device="cpu")
    params["checkpoints"]["every_steps"] = 4
    pretrain["sample"]["max_new_tokens"] = 6
    for sample in params["eval"]["samples"].values():
        sample["max_new_tokens"] = 5
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory: pytest.TempPathFactory, shared_data: Path, empty_store: Path) -> Path:
    """A git + DVC repo holding a copy of the pipeline's definition and code, `dvc repro tokenize` run.

    Made once for the module's end-to-end tests, which each train on a copy: download and tokenize
    are not what they test. Its commands get a store of their own, as a test's would.
    """
    project = tmp_path_factory.mktemp("tokenized") / "project"
    copy_code(project)
    tiny_params(project)
    git(project, "init", "-q")
    dvc(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "tiny")
    environment = {**env(), **isolated_environment(tmp_path_factory, empty_store)}
    helpers.dvc(project, "repro", "tokenize", env=environment, timeout=600)
    return project


@pytest.fixture
def project(tmp_path: Path, tokenized: Path) -> Path:
    """A copy of `tokenized`, the pipeline's data prepared, nothing trained."""
    shutil.copytree(tokenized, tmp_path, symlinks=True, dirs_exist_ok=True)
    return tmp_path


def env() -> dict[str, str]:
    # One thread: much faster for a tiny model on a busy CPU; the same for every run compared.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def dvc(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return helpers.dvc(project, *args, env=env(), timeout=600)


def snapshot(project: Path) -> dict[str, bytes]:
    return {name: (project / name).read_bytes() for name in OUTPUTS}


def newest_step(project: Path) -> int:
    runs = project / ".gptlab" / "runs" / "pretrain"
    found = [int(c.name.removeprefix("step-")) for run in runs.glob("*") for c in list_checkpoints(run)]
    return max(found, default=0)


def set_checkpoints(project: Path, **cadence: int | None) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["checkpoints"].update(cadence)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def kill_mid_run(project: Path, delay: float) -> None:
    """`dvc repro pretrain`, killed with SIGKILL (dvc and the stage together) `delay` s after its first new checkpoint."""
    after_step = newest_step(project) + 1
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("dvc")), "repro", "pretrain"],
        cwd=project,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the kill takes the stage down too
    )
    deadline = time.monotonic() + 300
    while newest_step(project) < after_step:
        assert proc.poll() is None, f"the pretrain stage ended before step {after_step}"
        assert time.monotonic() < deadline, f"no checkpoint of step {after_step} within 300 s"
        time.sleep(0.02)
    time.sleep(delay)  # somewhere in the next steps, evaluations or saves
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (project / "reports/pretrain/metrics.json").exists(), "the stage finished before the kill"


@pytest.mark.slow
def test_pretrain_and_eval_through_dvc_killed_resumed_and_rerun_identically(project: Path) -> None:
    chance = random.Random(20261130)  # three kill points, random but the same every run
    for _ in range(3):
        kill_mid_run(project, delay=chance.uniform(0.0, 0.3))
    # Saving is operational: the resume, then the rerun, each on another checkpoint cadence.
    set_checkpoints(project, every_steps=None, every_minutes=30, keep=1)

    resumed = dvc(project, "repro", "pretrain", "eval")
    assert "resuming from" in resumed.stderr + resumed.stdout
    first = snapshot(project)
    assert not list((project / ".gptlab" / "runs" / "pretrain").iterdir()), "finished runs leave no state"
    set_checkpoints(project, every_steps=2, every_minutes=None, keep=3)
    assert (
        "Data and pipelines are up to date" in dvc(project, "status", "tokenize", "pretrain", "eval").stdout
    )

    # A clean rerun from scratch, on yet another cadence, ends byte-identical to the interrupted-and-resumed one
    # (pretrain alone: its data, upstream, is unchanged).
    dvc(project, "repro", "--force", "--single-item", "pretrain")
    assert snapshot(project) == first
    assert "Stage 'eval' didn't change" in dvc(project, "repro", "eval").stdout  # same checkpoint bytes

    metrics = json.loads((project / "reports/pretrain/metrics.json").read_text())
    counted = json.loads((project / "reports/pretrain/counts.json").read_text())
    assert counted == {"steps": 2 * 12, "epochs": 2, "tokens_seen": 24 * 8 * 32}
    assert not {"steps", "epochs", "tokens_seen"} & set(metrics)
    assert metrics["final_train_loss"] < metrics["initial_train_loss"] - 1.0
    assert 10.5 < metrics["initial_val_loss"] < 11.5  # ln(50257) = 10.8: an untrained model guesses
    losses = pd.read_csv(project / "reports/pretrain/losses.csv")
    assert list(losses.columns) == ["step", "tokens_seen", "train_loss", "val_loss"]
    assert losses["step"].tolist() == list(range(0, 24, 4))
    assert (project / "reports/pretrain/loss.png").read_bytes()[:4] == b"\x89PNG"
    model, metadata = load_model(project / "models/pretrain")
    assert (model.cfg.emb_dim, model.cfg.context_length) == (32, 32)
    assert (
        metadata["stage"] == "pretrain" and metadata["metrics"] == metrics and metadata["counts"] == counted
    )

    evaluated = json.loads((project / "reports/eval/metrics.json").read_text())
    assert set(evaluated) == {"train_loss", "val_loss", "train_perplexity", "val_perplexity"}
    assert evaluated["val_perplexity"] == pytest.approx(2.718281828 ** evaluated["val_loss"])
    samples = json.loads((project / "reports/eval/samples.json").read_text())
    assert set(samples) == {"greedy", "temperature_top_k"}
    assert all(s["text"].startswith("Every effort moves you") for s in samples.values())

    shown = dvc(project, "metrics", "show", "--json").stdout
    assert "final_val_perplexity" in shown and "val_perplexity" in shown
    assert "reports/pretrain/losses.csv" in dvc(project, "plots", "show", "--json").stdout

    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name("gptlab")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    by_name: dict[str, list] = {}
    for run in runs:
        by_name.setdefault(run.info.run_name, []).append(run)
    *killed, resumed_run, rerun = by_name["pretrain"]
    # kill -9 leaves no chance to close a run; each rerun marks its dead predecessors KILLED.
    assert [run.info.status for run in killed] == ["KILLED"] * 3
    assert all(run.info.status != "RUNNING" for run in runs)
    assert resumed_run.data.tags["gptlab.resumed_from_step"].isdigit()
    assert "gptlab.resumed_from_step" not in rerun.data.tags
    assert rerun.data.params["pretrain.model.emb_dim"] == "32"
    history = client.get_metric_history(rerun.info.run_id, "pretrain/curves/val_loss")
    assert [m.step for m in history] == losses["step"].tolist()
    assert [m.value for m in history] == pytest.approx(losses["val_loss"].tolist())
    assert "pretrain/final_val_perplexity" in rerun.data.metrics
    assert (
        float(rerun.data.tags["gptlab.wall_seconds"]) > 0
        and float(rerun.data.tags["gptlab.tokens_per_second"]) > 0
    )
    # The curves under the stage's prefix; the epoch counter and time are no metrics.
    curves = {m for m in rerun.data.metrics if m.startswith("pretrain/curves/")}
    assert curves == {f"pretrain/curves/{m}" for m in ("train_loss", "val_loss", "tokens_seen")}
    assert all("/" in m for m in rerun.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(rerun.info.run_id, "pretrain")}
    assert {
        "pretrain/loss.png",
        "pretrain/samples.txt",
        "pretrain/reports",
        "pretrain/stage_seconds.json",
    } <= artifacts
    # The checkpoint is logged once, as the run's model (a text-generation pyfunc), and registered.
    assert "pretrain/model" not in artifacts
    (model_output,) = client.get_run(rerun.info.run_id).outputs.model_outputs
    assert rerun.data.tags["gptlab.model_uri"] == f"models:/{model_output.model_id}"
    assert client.search_model_versions("name = 'gptlab-pretrain'")
    # The initial losses once, at step 0; the final figures at the last step.
    assert [m.step for m in client.get_metric_history(rerun.info.run_id, "pretrain/initial_val_loss")] == [0]
    assert [m.step for m in client.get_metric_history(rerun.info.run_id, "pretrain/final_val_loss")] == [23]
    assert rerun.data.tags["gptlab.steps"] == "24"
    assert rerun.data.tags["gptlab.checkpoint_sha256"] == sha256_file(
        project / "models/pretrain" / WEIGHTS_FILE
    )
    reports = {a.path for a in client.list_artifacts(rerun.info.run_id, "pretrain/reports")}
    assert "pretrain/reports/loss.png" not in reports and "pretrain/reports/counts.json" in reports
    # Its input: the Verdict splits, hashed as DVC hashes them.
    (data_input,) = client.get_run(rerun.info.run_id).inputs.dataset_inputs
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["pretrain"]
    locked = next(dep for dep in lock["deps"] if dep["path"] == "data/processed/verdict")
    assert data_input.dataset.digest == locked["md5"]
    assert json.loads(data_input.dataset.profile)["train_windows"] == 96
    (eval_run,) = by_name["eval"]
    assert {m for m in eval_run.data.metrics if not m.startswith("system/")} == {
        "eval/train_loss",
        "eval/val_loss",
        "eval/train_perplexity",
        "eval/val_perplexity",
    }
    # The resumed pretrain and the eval came from one `dvc repro`: one shared tag finds both.
    assert eval_run.data.tags["gptlab.pipeline_run"] == resumed_run.data.tags["gptlab.pipeline_run"]
    assert eval_run.data.tags["gptlab.pipeline_run"] != rerun.data.tags["gptlab.pipeline_run"]
    # The eval run links the pretrain run that wrote the checkpoint it scored (found by its weights).
    assert eval_run.data.tags["gptlab.upstream_run_id"] == resumed_run.info.run_id
    assert (
        f"/runs/{resumed_run.info.run_id}?workflowType=machine_learning)"
        in eval_run.data.tags["mlflow.note.content"]
    )


def stop_after_a_new_checkpoint(project: Path, stop: signal.Signals) -> int:
    """Start the pretrain stage, send it `stop` once it saved a checkpoint of its own; the step it kept.

    It must end at once with the shell's 128 + signal, saying so in one line, before it finished.
    """
    before = newest_step(project)
    stage = subprocess.Popen(
        [sys.executable, "stages/pretrain.py"],
        cwd=project,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,  # noqa: PLW1509 - one signal.signal call after the fork
    )
    deadline = time.monotonic() + 300
    while newest_step(project) == before:
        assert stage.poll() is None, "the pretrain stage ended before a checkpoint of its own"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.02)
    stage.send_signal(stop)
    _, err = stage.communicate(timeout=120)
    assert stage.returncode == 128 + stop, err[-3000:]
    said = [line for line in err.splitlines() if "stopped by" in line]
    assert len(said) == 1 and f"stopped by {stop.name}" in said[0] and "Traceback" not in err, err[-3000:]
    assert not (project / "reports/pretrain/metrics.json").exists(), "the stage finished before the signal"
    saved = newest_step(project)
    assert saved > before  # the state is kept (a save in flight is finished, not cut)
    return saved


@pytest.mark.slow
def test_a_signal_ends_the_run_killed_and_keeps_what_the_rerun_resumes(project: Path) -> None:
    """SIGTERM (what `dvc queue kill`, `timeout` and schedulers send), then Ctrl-C in the resumed run:
    each run ends KILLED at once, not left RUNNING, and the last rerun resumes from what was kept."""
    client = MlflowClient(tracking_uri())

    def pretrain_runs() -> dict[str, Any]:
        experiment = client.get_experiment_by_name("gptlab")
        runs = client.search_runs(
            [experiment.experiment_id], filter_string="tags.`gptlab.stage` = 'pretrain'"
        )
        return {run.info.run_id: run for run in runs}

    stopped: dict[str, Any] = {}
    for stop in (signal.SIGTERM, signal.SIGINT):
        saved = stop_after_a_new_checkpoint(project, stop)
        (killed,) = (run for run_id, run in pretrain_runs().items() if run_id not in stopped)
        assert killed.info.status == "KILLED" and killed.info.end_time is not None, stop.name
        stopped[killed.info.run_id] = killed
    assert saved >= 8  # two checkpoints of 4 steps, one per run

    resumed = subprocess.run(
        [sys.executable, "stages/pretrain.py"], cwd=project, env=env(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    counted = json.loads((project / "reports/pretrain/counts.json").read_text())
    assert counted["steps"] == 2 * 12
    runs = pretrain_runs()
    assert [runs.pop(run_id).info.status for run_id in stopped] == [
        "KILLED",
        "KILLED",
    ]  # no rerun closed them
    (rerun,) = runs.values()
    assert rerun.info.status == "FINISHED" and rerun.data.tags["gptlab.resumed_from_step"] == str(saved)


def test_loss_figure_puts_epochs_below_and_tokens_seen_above() -> None:
    history = [
        {
            "step": step,
            "tokens_seen": (step + 1) * 512,
            "train_loss": 10.0 - step,
            "val_loss": 10.5 - step / 2,
        }
        for step in range(0, 9, 3)
    ]
    figure = plot_losses(history, steps_per_epoch=3)
    bottom, top = figure.axes
    train, val = bottom.lines
    assert list(train.get_xdata()) == [1 / 3, 4 / 3, 7 / 3]  # after step s: (s + 1) / steps_per_epoch epochs
    assert list(val.get_ydata()) == [10.5, 9.0, 7.5]
    assert list(top.lines[0].get_xdata()) == [512, 2048, 3584]
    assert (bottom.get_xlabel(), top.get_xlabel()) == ("Epochs", "Tokens seen")


def test_bad_settings_and_missing_data_fail_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tiny_params(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"verdict/train\.npy not found: run `dvc repro tokenize`"):
        pretrain_stage.run(load_params())
    text = (tmp_path / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text.replace("max_length: 32", "max_length: 64"))
    with pytest.raises(ConfigError, match="pretrain.data.max_length: 64 exceeds model.context_length=32"):
        load_params()
    (tmp_path / "params.yaml").write_text(text.replace("lr: 0.005", "lr: fast"))
    with pytest.raises(ConfigError, match="pretrain.train.lr: expected a float, got 'fast'"):
        load_params()
    assert not (tmp_path / "reports").exists() and not (tmp_path / "models").exists()


def test_damaged_token_ids_and_a_batch_beyond_the_data_fail_before_any_model_or_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: an IndexError traceback mid-run, or a refusal after seconds of work, before; one line now."""
    monkeypatch.chdir(tmp_path)
    tiny_params(tmp_path)
    params = load_params()
    ids = np.arange(1000, 1400, dtype=np.int32)  # 400 tokens: 8 windows of 32, 48 apart
    verdict.save_split(params.data.processed_dir, "val", ids)
    damaged = ids.copy()
    damaged[123] = 50257
    train = verdict.save_split(params.data.processed_dir, "train", damaged)
    with pytest.raises(InputError, match=re.escape(f"{train}: token id 50257 at index 123 is outside")):
        pretrain_stage.run(params)
    verdict.save_split(params.data.processed_dir, "train", ids)
    with pytest.raises(
        InputError, match=r"has 8 examples, fewer than one batch of pretrain\.train\.batch_size=9"
    ):
        pretrain_stage.run(
            dataclasses.replace(
                params,
                pretrain=dataclasses.replace(
                    params.pretrain, train=dataclasses.replace(params.pretrain.train, batch_size=9)
                ),
            )
        )
    assert not (tmp_path / "models").exists() and not (tmp_path / ".gptlab").exists()
    assert MlflowClient(tracking_uri()).search_experiments(filter_string="name = 'gptlab'") == []


def test_spam_refuses_a_batch_beyond_its_data_before_loading_the_base_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages import spam_finetune

    monkeypatch.chdir(tmp_path)
    tiny_params(tmp_path)
    params = load_params()
    for split in spam.SPLITS:
        frame = pd.DataFrame({"text": ["hello", "win a prize"], "label": [0, 1]})
        spam.save_split(params.data.processed_dir, split, frame, np.array([[31373, 50256], [5404, 257]]))
    with pytest.raises(
        InputError, match=r"has 2 examples, fewer than one batch of spam\.train\.batch_size=8"
    ):
        spam_finetune.run(params)  # models/gpt2/ does not exist: the data was checked first
