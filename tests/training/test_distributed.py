"""`fit` under torchrun: two CPU processes (gloo) train one tiny GPT data-parallel, then resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gptlab.model import checkpoint
from gptlab.model.checkpoint import WEIGHTS_FILE
from gptlab.schema import ConfigError
from gptlab.training.config import DistributedConfig
from gptlab.training.data_order import epoch_order, rank_order
from gptlab.training.distributed import EXIT_PEER_LOST, EXIT_RANK_FAILED, World, failure_line, launches, world

TESTS_DIR = Path(__file__).resolve().parent

# Each rank trains test_train's tiny run and writes what it ended with to OUT/rank<r>.json.
SCRIPT = """
import hashlib, json, sys
from pathlib import Path

import torch

sys.path[:0] = [{tests_dir!r}, {helpers_dir!r}]  # test_train beside this file, helpers in tests/
from test_train import CHECKPOINTS, TRAIN, tiny_model, verdict_data

from gptlab.training.distributed import world
from gptlab.training.losses import next_token_loss
from gptlab.training.loop import fit

torch.set_num_threads(1)
checkpoint_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
train_data, val_data = verdict_data()
model = tiny_model()
result = fit(
    model, train_data, val_data, cfg=TRAIN, checkpoints=CHECKPOINTS, loss_fn=next_token_loss, run_dir=checkpoint_dir
)
state = model.state_dict()
digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{{world().rank}}.json").write_text(json.dumps({{
    "weights": digest, "history": result.history, "epochs": result.epochs,
    "steps": result.steps, "seen": result.seen, "resumed_steps": result.resumed_steps,
}}))
"""


def torchrun(script: Path, checkpoint_dir: Path, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, str(script), str(checkpoint_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_rank_order_splits_whole_batches_round_robin() -> None:
    order = epoch_order(26, 7, 0)
    assert rank_order(order, 4, World()) is order
    shares = [rank_order(order, 4, World(rank=r, local_rank=r, size=2)) for r in range(2)]
    # 6 batches of 4: rank 0 takes batches 0, 2, 4 and rank 1 batches 1, 3, 5; 2 examples left over.
    assert shares[0] == order[0:4] + order[8:12] + order[16:20]
    assert shares[1] == order[4:8] + order[12:16] + order[20:24]


def test_without_torchrun_the_world_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world() == World(rank=0, local_rank=0, size=1)


@pytest.mark.slow
def test_two_processes_train_in_step_and_resume_exactly(tmp_path: Path) -> None:
    script = tmp_path / "train_ddp.py"
    script.write_text(SCRIPT.format(tests_dir=str(TESTS_DIR), helpers_dir=str(TESTS_DIR.parent)))
    checkpoint_dir = tmp_path / "run"

    first = torchrun(script, checkpoint_dir, tmp_path / "first")
    steps = 2 * (26 // 4 // 2)  # 2 epochs of 3 steps per rank
    for rank in first:
        assert rank["steps"] == steps and rank["resumed_steps"] == 0
        assert rank["seen"] == steps * 2 * 4 * 16  # summed over both ranks
    assert first[0]["weights"] == first[1]["weights"], "the ranks' weights drifted apart"
    assert first[0]["history"] == first[1]["history"], "the ranks saw different evaluation losses"
    history = first[0]["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.3
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert [row["epoch"] for row in first[0]["epochs"]] == [1, 2]

    # Saves at steps 3 (epoch end), 4, 6 (epoch end, last); keep 2. Rank 0 wrote them all.
    kept = checkpoint.list_checkpoints(checkpoint_dir)
    assert [p.name for p in kept] == ["step-0000004", "step-0000006"]
    _, state = checkpoint.load_training_checkpoint(kept[-1])
    assert state["world_size"] == 2 and len(state["rank_rngs"]) == 2

    # Damage the last checkpoint (same size, other weights): rank 0 refuses and deletes it, every
    # rank resumes at step 4 with its own RNG state and ends exactly where the first run did.
    weights = kept[-1] / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    weights.write_bytes(bytes(data))
    resumed = torchrun(script, checkpoint_dir, tmp_path / "resumed")
    for rank in resumed:
        assert rank["resumed_steps"] == 4
        assert rank["weights"] == first[0]["weights"]
        assert rank["history"] == history
    assert [p.name for p in checkpoint.list_checkpoints(checkpoint_dir)] == ["step-0000004", "step-0000006"]


def test_a_failed_launch_names_the_rank_that_died_first_in_one_line() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGKILL, error_file="")
    left = ProcessFailure(local_rank=0, pid=4241, exitcode=EXIT_PEER_LOST, error_file="")
    code, line = failure_line({0: left, 1: killed})
    assert code == EXIT_RANK_FAILED
    assert (
        line is not None and line.startswith("rank 1 (pid 4242) was killed by SIGKILL;") and "\n" not in line
    )
    crashed = ProcessFailure(local_rank=0, pid=4241, exitcode=1, error_file="")  # a bug: its traceback above
    assert "rank 0 (pid 4241) failed with exit code 1" in str(failure_line({0: crashed, 1: left}))
    said = ProcessFailure(local_rank=0, pid=4241, exitcode=2, error_file="")  # its own line said why
    assert failure_line({0: said, 1: left}) == (2, None)


def test_more_nodes_need_the_address_of_node_0() -> None:
    assert DistributedConfig().processes == 1 and not launches(DistributedConfig())
    assert DistributedConfig(nproc_per_node=4, nnodes=2, rdzv_endpoint="node0.example:29400").processes == 8
    with pytest.raises(ConfigError, match="rdzv_endpoint: nnodes is 2: set rdzv_endpoint"):
        DistributedConfig(nnodes=2)
    with pytest.raises(ConfigError, match="rdzv_endpoint: expected host:port"):
        DistributedConfig(nnodes=2, rdzv_endpoint="node0.example")
