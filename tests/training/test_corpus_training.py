"""The loop on the corpus path: token shards, a token budget, a global batch reached by accumulation.

One process accumulating 2 micro-batches a step is the reference; 2 torchrun processes (one
machine, then two "nodes" through c10d rendezvous on localhost) must take the same steps, and a
run killed with SIGKILL must resume to exactly the reference's numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptlab.data.corpus_windows import ShardWindows, spread_sample
from gptlab.data.token_shards import ShardWriter, shard_paths
from gptlab.errors import InputError
from gptlab.model import checkpoint
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.tokenizer import load_tokenizer
from gptlab.training.distributed import world
from gptlab.training.loop import fit
from gptlab.training.losses import next_token_loss

from helpers import checkpoint_config, free_port, inputs_dir, train_config

TESTS_DIR = Path(__file__).resolve().parent
CONTEXT, BATCH = 16, 2
# No dropout: each torchrun process draws its own masks, which one process cannot replay.
TINY = ModelConfig(context_length=CONTEXT, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0)
# 2 micro-batches of 2 windows of 16 tokens a step; 7 steps of the budget (the 36 windows hold 9);
# appendix D's warm-up, cosine decay and clipping.
TRAIN = train_config(
    batch_size=BATCH,
    epochs=1,
    lr=5e-3,
    eval_freq=2,
    eval_iter=2,
    seed=7,
    rng="per_epoch",
    fused_adamw=True,
    global_batch_tokens=2 * BATCH * CONTEXT,
    max_tokens=7 * 2 * BATCH * CONTEXT,
    warmup_steps=2,
    lr_schedule="cosine",
    min_lr=5e-4,
    grad_clip=1.0,
)
CHECKPOINTS = checkpoint_config(every_steps=2, keep=2)


def write_corpus(folder: Path) -> Path:
    """The Verdict's first tokens as a tiny corpus: 3 training shards of 200 ids, one validation shard."""
    inputs = inputs_dir()
    ids = load_tokenizer(inputs).encode((inputs / "the-verdict.txt").read_text(encoding="utf-8"))
    for prefix, part in (("train", ids[:600]), ("val", ids[1000:1100])):
        writer = ShardWriter(folder, prefix, shard_tokens=200)
        writer.write(part)
        writer.close()
    return folder


def corpus_fit(corpus: str, run_dir: str, out: str, step_delay: float = 0.0) -> None:
    """Train the tiny GPT on the corpus; write the history and (rank 0) the weights to `out`.

    The entry point of every process in this module's subprocesses (`python -c`, torchrun).
    """
    torch.set_num_threads(1)

    def paced_loss(model: torch.nn.Module, batch) -> torch.Tensor:
        if model.training and step_delay:
            time.sleep(step_delay)  # paces the run so the kill lands mid-training
        return next_token_loss(model, batch)

    train = ShardWindows(shard_paths(Path(corpus), "train"), CONTEXT, CONTEXT)
    val = spread_sample(ShardWindows(shard_paths(Path(corpus), "val"), CONTEXT, CONTEXT), 4)
    torch.manual_seed(123)
    model = build_gpt(TINY)
    result = fit(
        model,
        train,
        val,
        cfg=TRAIN,
        checkpoints=CHECKPOINTS,
        loss_fn=paced_loss,
        run_dir=Path(run_dir),
    )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rank = world().rank
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "weights.safetensors")
    payload = {"history": result.history, "steps": result.steps, "resumed_steps": result.resumed_steps}
    (folder / f"rank{rank}.json").write_text(json.dumps(payload))


def launch(corpus: Path, run_dir: Path, out: Path, *torchrun_args: str, step_delay: float = 0.0) -> list:
    """The command that runs corpus_fit, under torchrun when given its arguments."""
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS_DIR)!r}, {str(TESTS_DIR.parent)!r}]; "
        f"import test_corpus_training as t; t.corpus_fit({str(corpus)!r}, {str(run_dir)!r}, {str(out)!r}, {step_delay})"
    )
    if not torchrun_args:
        return [sys.executable, "-c", code]
    script = out.parent / f"{out.name}.py"
    script.write_text(code)
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(script)]


def clean_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def outcome(out: Path, ranks: int = 1) -> tuple[list[dict], dict[str, torch.Tensor]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], load_file(
        out / "weights.safetensors"
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """One process, accumulating 2 micro-batches a step, uninterrupted."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run(launch(corpus, out / "run", out), env=clean_env(), check=True, timeout=120)
    return outcome(out)


def assert_same_training(ranks: list[dict], weights: dict, reference) -> None:
    (expected,), expected_weights = reference
    for rank in ranks:
        assert rank["steps"] == expected["steps"] == 7
        assert [row["step"] for row in rank["history"]] == [row["step"] for row in expected["history"]]
        for row, want in zip(rank["history"], expected["history"], strict=True):
            assert row["tokens_seen"] == want["tokens_seen"] and row["lr"] == want["lr"]
            for key in ("train_loss", "val_loss"):
                assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6)
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5)


def test_the_budget_and_global_batch_set_steps_tokens_and_schedule(reference) -> None:
    (ranks,), _ = reference
    history = ranks["history"]
    assert ranks["steps"] == 7 and [row["step"] for row in history] == [0, 2, 4, 6]
    assert [row["tokens_seen"] for row in history] == [(s + 1) * 2 * BATCH * CONTEXT for s in (0, 2, 4, 6)]
    assert (
        history[0]["lr"] == TRAIN.lr / 2 and history[-1]["lr"] == TRAIN.min_lr
    )  # warm-up, cosine to the floor
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.3


@pytest.mark.slow
def test_two_processes_equal_one_process_accumulating_twice(corpus: Path, reference, tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    cmd = launch(corpus, tmp_path / "run", out, "--standalone", "--nproc_per_node=2")
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_training(*outcome(out, ranks=2), reference)


@pytest.mark.slow
def test_two_nodes_meet_through_c10d_rendezvous_on_localhost(corpus: Path, reference, tmp_path: Path) -> None:
    out = tmp_path / "nodes"
    rendezvous = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_id=gptlab-test"]
    rendezvous.append(f"--rdzv_endpoint=127.0.0.1:{free_port()}")
    nodes = [
        subprocess.Popen(
            launch(corpus, tmp_path / "run", out, *rendezvous),
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert_same_training(*outcome(out, ranks=2), reference)


@pytest.mark.slow
def test_a_corpus_run_killed_with_sigkill_resumes_exactly(corpus: Path, reference, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.Popen(launch(corpus, run_dir, out, step_delay=0.3), env=clean_env())
    deadline = time.monotonic() + 120
    while not checkpoint.list_checkpoints(run_dir):
        assert proc.poll() is None, "training ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint appeared within 120 s"
        time.sleep(0.02)
    time.sleep(0.3)  # inside the next step, or the next save
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "rank0.json").exists(), (
        "training finished before it was killed; the test proved nothing"
    )
    survivors = checkpoint.list_checkpoints(run_dir)
    assert int(survivors[-1].name.removeprefix("step-")) < 7

    subprocess.run(launch(corpus, run_dir, out), env=clean_env(), check=True, timeout=120)
    (resumed,), weights = outcome(out)
    (expected,), expected_weights = reference
    assert resumed["resumed_steps"] > 0
    assert resumed["history"] == expected["history"]  # bit for bit: same process layout, same machine
    assert all(torch.equal(weights[k], v) for k, v in expected_weights.items())


def test_a_global_batch_that_is_no_multiple_of_the_micro_batch_is_one_line(corpus: Path, tmp_path) -> None:
    train = ShardWindows(shard_paths(corpus, "train"), CONTEXT, CONTEXT)
    cfg = dataclasses.replace(TRAIN, global_batch_tokens=3 * CONTEXT)
    with pytest.raises(
        InputError, match=r"train.global_batch_tokens=48 is no multiple .* pick a multiple of 32"
    ):
        fit(
            build_gpt(TINY),
            train,
            train,
            cfg=cfg,
            checkpoints=CHECKPOINTS,
            loss_fn=next_token_loss,
            run_dir=tmp_path,
        )
