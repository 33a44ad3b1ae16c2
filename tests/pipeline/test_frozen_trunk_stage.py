"""spam-finetune with its frozen trunk computed once and without: the same output bytes, killed and resumed across paths.

The stage script runs as DVC runs it, in a copy of the project with a tiny base model
(3 blocks, chapter 6's last block trained) and a slice of the spam data.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data import spam
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import list_checkpoints, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.tokenizer import load_tokenizer
from gptlab.pipeline.params import load_params

from helpers import committed_params_raw, copy_code

ROWS = 40  # per split: 5 training batches of 8
EPOCHS = 6
OUTPUTS = (
    "reports/spam/metrics.json",
    "reports/spam/counts.json",
    "reports/spam/losses.csv",
    "reports/spam/accuracy.csv",
    "reports/spam/predictions.csv",
    "reports/spam/confusion_matrix.png",
    "models/spam/model.safetensors",
    "models/spam/config.json",
)
RUNS = Path(".gptlab") / "runs" / "spam-finetune"


def write_params(project: Path, cache: bool) -> None:
    """The committed params (chapter 6's procedure) on a tiny slice, checkpointing every 2 steps."""
    params = committed_params_raw()
    params["tokenize"]["spam"]["max_rows"] = ROWS
    params["tracking"].update(system_metrics=False, log_models=False)
    params["spam"]["cache_frozen_trunk"] = cache
    params["spam"]["train"].update(epochs=EPOCHS, lr=1e-3, eval_freq=3, eval_iter=2, device="cpu")
    params["checkpoints"]["every_steps"] = 2
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def project(tmp_path: Path, shared_data: Path) -> Path:
    """A copy of the project holding the tokenized slice and a tiny random gpt2-small stand-in."""
    project = tmp_path / "project"
    copy_code(project)
    write_params(project, cache=True)
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
    base = ModelConfig(context_length=128, emb_dim=32, n_heads=2, n_layers=3, drop_rate=0.1, qkv_bias=True)
    save_model(build_gpt(base), project / "models" / "gpt2" / "gpt2-small", {"source": "test"})
    return project


def env(project: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(project / "src"),  # the copy's own code
        "OMP_NUM_THREADS": "1",  # a tiny model: one thread, and the same for every run compared
    }


def run_stage(project: Path, cache: bool) -> str:
    """The stage, to its end, on the path `cache` names; its output."""
    write_params(project, cache)
    done = subprocess.run(
        [sys.executable, "stages/spam_finetune.py"],
        cwd=project,
        env=env(project),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def snapshot(project: Path) -> dict[str, bytes]:
    return {name: (project / name).read_bytes() for name in OUTPUTS}


def newest_step(project: Path) -> int:
    found = [
        int(c.name.removeprefix("step-")) for run in (project / RUNS).glob("*") for c in list_checkpoints(run)
    ]
    return max(found, default=0)


def kill_mid_run(project: Path, cache: bool, at_step: int) -> None:
    """The stage on the path `cache` names, killed with SIGKILL once its checkpoint of `at_step` steps exists."""
    write_params(project, cache)
    for name in OUTPUTS:
        (project / name).unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "stages/spam_finetune.py"],
        cwd=project,
        env=env(project),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while newest_step(project) < at_step:
        assert proc.poll() is None, f"the stage ended before step {at_step}"
        assert time.monotonic() < deadline, f"no checkpoint of step {at_step} within 300 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (project / "reports/spam/metrics.json").exists(), "the stage finished before the kill"


@pytest.mark.slow
def test_cached_and_whole_model_stages_write_the_same_bytes_even_killed_and_resumed_across_paths(
    project: Path,
) -> None:
    whole_out = run_stage(project, cache=False)
    whole = snapshot(project)
    assert "frozen trunk cache off: spam.cache_frozen_trunk is false" in whole_out

    cached_out = run_stage(project, cache=True)
    assert "frozen trunk cache on: the embeddings and blocks 0-1 computed once (" in cached_out
    assert snapshot(project) == whole

    # Killed on each path, resumed on the other: the training loop's checkpoints hold the weights,
    # the cache is computed again.
    for cut, resume in ((True, False), (False, True)):
        kill_mid_run(project, cache=cut, at_step=12)
        resumed_out = run_stage(project, cache=resume)
        assert "resuming from" in resumed_out
        assert snapshot(project) == whole, f"cut {'cached' if cut else 'whole'}, resumed on the other path"
    assert not list((project / RUNS).iterdir()), "finished runs leave no state, and the cache no file"

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("gptlab")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    paths = [run.data.params["spam.frozen_trunk_cache"].split(":")[0] for run in runs]
    assert paths == ["off", "on", "on", "off", "off", "on"]
