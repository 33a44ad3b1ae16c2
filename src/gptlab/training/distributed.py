"""Data-parallel training under `torchrun`: starting it, who this process is, and the collectives `fit` needs.

`torchrun --nproc_per_node=N` starts N copies of a stage, each with RANK,
LOCAL_RANK and WORLD_SIZE in its environment. Without them (a plain `python`
run) the world is one process and every helper here is a no-op that returns
its input unchanged, so single-process training is untouched. A training stage
whose params ask for more processes (`distributed`) starts itself that way
(`launch`): torch.distributed.run's elastic agent, in the stage's own process,
so DVC runs and records it as any stage; a process that fails ends them all.
torch is imported only by the helpers that need it: `is_main` answers a stage that
uses no torch (download) without loading it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gptlab.errors import EXIT_USAGE
from gptlab.training.config import DistributedConfig

if TYPE_CHECKING:
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

# Exit code of a process whose collective failed because a peer is gone: the launcher names that peer.
EXIT_PEER_LOST = 3
# Exit code of a launch whose process died or failed with no line of its own (1 stays "a check failed").
EXIT_RANK_FAILED = 4
# How often the agent looks at its processes: a dead one stops the rest within this and 30 s.
MONITOR_SECONDS = 1.0


@dataclass(frozen=True)
class World:
    """This process's place in the job: global rank, rank on its machine, number of processes."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1


def world() -> World:
    """The world torchrun describes in the environment; one process without it."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    # torch on first use: the download stage never loads it
    import torch.distributed as dist

    if not dist.is_available():
        return World()
    return World(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), size)


def is_main() -> bool:
    """True on rank 0, the one process that logs, prints and writes files."""
    return world().rank == 0


def setup(timeout_minutes: float | None = None) -> World:
    """Join the process group once (gloo for CPU tensors, nccl for CUDA ones); returns the world.

    A collective that waits longer than `timeout_minutes` for a peer fails (None: torch's default).
    """
    # torch on first use: the download stage never loads it
    import torch
    import torch.distributed as dist

    w = world()
    if w.size > 1 and not dist.is_initialized():
        timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
        if torch.cuda.is_available():
            torch.cuda.set_device(w.local_rank)
            dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return w


def launches(cfg: DistributedConfig) -> bool:
    """True where a training stage must start itself on `cfg`'s processes: more than one, not yet started."""
    return cfg.processes > 1 and "WORLD_SIZE" not in os.environ


def launch(cfg: DistributedConfig, script: str, args: Sequence[str]) -> int:
    """Run `script args` on every process of `cfg` through torch.distributed.run; the exit code.

    One node: torchrun's standalone rendezvous on this machine. Several: a static rendezvous at
    rdzv_endpoint where this node is node 0 (ranks 0 to nproc_per_node - 1, rank 0 writing the
    outputs DVC records), and the others join it with torchrun. No restarts: a process that dies
    stops the others (SIGTERM, then SIGKILL after torch's 30 s), and one line names it. A
    signal to this process (Ctrl-C, `dvc queue kill`) goes on to every process.
    """
    # torch on launch only: the plain single process never loads the elastic agent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    where = ["--standalone"]
    if cfg.nnodes > 1:
        where = ["--rdzv_backend=static", f"--rdzv_endpoint={cfg.rdzv_endpoint}", "--node_rank=0"]
    argv = [
        f"--nnodes={cfg.nnodes}",
        f"--nproc_per_node={cfg.nproc_per_node}",
        "--max_restarts=0",
        f"--monitor_interval={MONITOR_SECONDS}",
        *where,
        script,
        *args,
    ]
    # The agent's own reports (its OMP_NUM_THREADS=1 notice, a failure's table): the line below says it.
    # Each of its loggers sets its own level, so each is quietened.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        code, line = failure_line(exc.failures)
        if line:
            print(f"\nerror: {line}", file=sys.stderr)
        return code
    except SignalException as exc:  # passed on to every process, which said so on rank 0
        return 128 + int(exc.sigval)
    return 0


def failure_line(failures: Mapping[int, ProcessFailure]) -> tuple[int, str | None]:
    """The exit code of a failed launch, and its line naming the rank that failed first (None: it said why).

    The agent reports the processes it stopped too, so the blame goes first to a rank killed by
    a signal other than its SIGTERM, then to one that failed on its own, then to one whose
    collective broke because a peer was gone (EXIT_PEER_LOST), last to one the agent stopped.
    """
    rank, failure = min(failures.items(), key=lambda item: (_blame(item[1].exitcode), item[0]))
    code = 128 + signal.SIGTERM if failure.exitcode == -signal.SIGTERM else failure.exitcode
    if code in (EXIT_USAGE, 128 + signal.SIGINT, 128 + signal.SIGTERM):  # its own line said why
        return code, None
    if code < 0:
        how = f"was killed by {failure.signal_name()}"
    elif code == EXIT_PEER_LOST:
        how = "lost its peers (a collective timed out, or the network failed)"
    else:
        how = f"failed with exit code {code}"
    return EXIT_RANK_FAILED, (
        f"rank {rank} (pid {failure.pid}) {how}; the stage's other processes were stopped: "
        "rerun it (it resumes from its last checkpoint)"
    )


def _blame(exitcode: int) -> int:
    """How likely a process that ended with `exitcode` is the job's root failure: 0 most, 3 least."""
    if exitcode < 0 and exitcode != -signal.SIGTERM:
        return 0  # killed: SIGKILL (out of memory, kill -9), SIGSEGV, ...
    if exitcode == EXIT_PEER_LOST:
        return 2
    if exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM):
        return 3  # the agent's stop (or a SIGTERM to this process alone)
    return 1


def peer_lost(exc: BaseException | None) -> bool:
    """True for a collective that failed because another process of the job is gone (or timed out).

    NCCL and the rendezvous store raise torch's DistError; gloo a RuntimeError that names it.
    """
    dist = sys.modules.get("torch.distributed")
    if exc is None or dist is None or world().size == 1:
        return False
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def local_device(device: torch.device) -> torch.device:
    """`device`, with CUDA pinned to this process's own GPU (cuda:LOCAL_RANK) under torchrun."""
    # torch on first use: the download stage never loads it
    import torch

    w = world()
    return torch.device("cuda", w.local_rank) if w.size > 1 and device.type == "cuda" else device


def all_mean(value: float) -> float:
    """The mean of `value` over all processes (itself when there is one)."""
    if setup().size == 1:
        return value
    # torch on first use: the download stage never loads it
    import torch
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64)  # CPU: goes through gloo
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def all_sum(value: int) -> int:
    """The sum of an integer over all processes (itself when there is one)."""
    if setup().size == 1:
        return value
    # torch on first use: the download stage never loads it
    import torch
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def barrier() -> None:
    """Wait until every process gets here (nothing to wait for with one process)."""
    if setup().size > 1:
        # torch on first use: the download stage never loads it
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1))  # a CPU tensor, so gloo serves it whatever the training device


def broadcast(value: Any) -> Any:
    """Rank 0's `value` (any picklable object), on every process."""
    if setup().size == 1:
        return value
    # torch on first use: the download stage never loads it
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every process's `value` (any picklable object), in rank order, on every process."""
    if setup().size == 1:
        return [value]
    # torch on first use: the download stage never loads it
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
