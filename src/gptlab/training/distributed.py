"""Data-parallel training under `torchrun`: who this process is, and the few collectives `fit` needs.

`torchrun --nproc_per_node=N` starts N copies of a stage, each with RANK,
LOCAL_RANK and WORLD_SIZE in its environment. Without them (a plain `python`
run) the world is one process and every helper here is a no-op that returns
its input unchanged, so single-process training is untouched.
torch is imported only by the helpers that need it: `is_main` answers a stage that
uses no torch (download) without loading it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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


def setup() -> World:
    """Join the process group once (gloo for CPU tensors, nccl for CUDA ones); returns the world."""
    # torch on first use: the download stage never loads it
    import torch
    import torch.distributed as dist

    w = world()
    if w.size > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(w.local_rank)
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
    return w


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
