"""`dvc exp run -S distributed.nproc_per_node=2`: pretrain starts itself on 2 processes through torchrun.

In a fresh copy of the project, with the real dvc: a tiny pretrain on one process accumulating
2 micro-batches a step, then on 2 processes (gloo) taking one each, must log the same losses and
be what dvc.lock records; a rank killed with SIGKILL then ends the stage within 60 s, in one line
naming it, and the 2-process run's checkpoints stay for the rerun.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

from gptlab.experiments.profiles import dvc_executable

from helpers import commit_as_fresh_clone, committed_params_raw, copy_project, dvc, project_env

CONTEXT, BATCH = 32, 2


def tiny_params() -> dict:
    """The committed params with a tiny, dropout-free pretrain whose step is 2 micro-batches."""
    params = committed_params_raw()
    params["tracking"].update(system_metrics=False, log_models=False)
    params["tokenize"]["spam"]["max_rows"] = 16
    params["tokenize"]["instruct"]["max_records"] = 8
    params["tokenize"]["preference"]["max_records"] = 8
    pretrain = params["pretrain"]
    # No dropout: each process draws its own masks, which one process cannot replay.
    pretrain["model"].update(context_length=CONTEXT, emb_dim=32, n_layers=1, n_heads=2, drop_rate=0.0)
    pretrain["data"].update(max_length=CONTEXT, stride=CONTEXT)
    pretrain["train"].update(
        batch_size=BATCH,
        epochs=1,
        max_steps=4,
        eval_freq=1,
        eval_iter=1,
        rng="per_epoch",  # the order torchrun's processes share (the book's draws assume one)
        global_batch_tokens=2 * BATCH * CONTEXT,
    )
    pretrain["sample"]["max_new_tokens"] = 2
    return params


def rank_process(parent: int, rank: int) -> psutil.Process | None:
    """The torchrun worker of `rank` under process `parent`, once started."""
    for child in psutil.Process(parent).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow
def test_dvc_exp_run_trains_pretrain_on_two_processes_and_a_killed_rank_ends_it(
    tmp_path: Path, shared_data: Path, isolated_tools: str
) -> None:
    project = tmp_path / "project"
    copy_project(project)
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False), encoding="utf-8")
    commit_as_fresh_clone(project)
    env = project_env(project, OMP_NUM_THREADS="1")
    losses = project / "reports" / "pretrain" / "losses.csv"

    dvc(project, "exp", "run", "pretrain", env=env, timeout=600)  # one process, 2 micro-batches a step
    one = pd.read_csv(losses)
    dvc(project, "exp", "run", "-S", "distributed.nproc_per_node=2", "pretrain", env=env, timeout=600)
    two = pd.read_csv(losses)
    assert list(two["step"]) == list(one["step"]) == [0, 1, 2, 3]
    assert list(two["tokens_seen"]) == list(one["tokens_seen"])
    for column in ("train_loss", "val_loss"):
        assert list(two[column]) == pytest.approx(list(one[column]), rel=1e-5, abs=1e-6)
    assert two["train_loss"].iloc[-1] != one["train_loss"].iloc[0]  # it trained
    stage = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["pretrain"]
    assert stage["params"]["params.yaml"]["distributed.nproc_per_node"] == 2
    assert dvc(project, "status", "pretrain", env=env).stdout.strip().endswith("up to date.")

    # A long run, killed in rank 1 once it has saved a checkpoint.
    long_run = ["-S", "pretrain.train.max_steps=null", "-S", "pretrain.train.epochs=1000"]
    proc = subprocess.Popen(
        [
            dvc_executable(),
            "exp",
            "run",
            "-S",
            "distributed.nproc_per_node=2",
            "-S",
            "checkpoints.every_steps=1",
        ]
        + [*long_run, "pretrain"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    runs = project / ".gptlab" / "runs" / "pretrain"
    deadline = time.monotonic() + 300
    while not list(runs.glob("*-2procs/step-*")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    worker = rank_process(proc.pid, 1)
    assert worker is not None, "no process of rank 1 under dvc"
    worker.kill()
    killed = time.monotonic()
    output = proc.communicate(timeout=120)[0]
    assert time.monotonic() - killed < 60, f"the stage took {time.monotonic() - killed:.0f} s to end"
    assert proc.returncode != 0
    named = [line for line in output.splitlines() if "rank 1" in line]
    assert len(named) == 1 and "SIGKILL" in named[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert list(runs.glob("*-2procs/step-*")), "the killed run's checkpoints are gone"
