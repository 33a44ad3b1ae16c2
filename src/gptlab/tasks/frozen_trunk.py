"""Chapter 6's frozen trunk computed once: what the embeddings and frozen blocks make of each message.

With `spam.trainable` head or last_blocks and no dropout below the first trainable
block, the output of the token and position embeddings and of the frozen blocks
is a fixed function of a message, yet every training step, evaluation and score
computed it again (11 of chapter 6's 12 blocks). Here it is computed once per
message, and a view of the classifier runs only the trainable top on it.

Exact, not approximate: on the CPUs measured (benchmarks/README.md) a row of a
matmul comes out the same whatever the other rows of its batch hold, though not
whatever their number. So each split is computed in the batch shapes its loaders
read: every training message in a batch of the training size (the shuffled
loader's), and each split in order in the evaluation loaders' batches, the last
short one included. A batch is read from the cache only when its number of rows,
its autocast and its token ids match cached ones; any other runs the whole model.
One batch drawn across the cached ones is checked bit for bit against the whole
model first, and a difference turns the cache off.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gptlab.data.spam import SpamDataset
from gptlab.model.gpt import GPTModel
from gptlab.tasks.config import SpamConfig, Trainable
from gptlab.training import distributed
from gptlab.training.losses import LossFn
from gptlab.training.runtime import Precision, autocast

# The cache spills to a memory-mapped file beyond this share of the machine's memory.
RAM_SHARE = 4
# Seed of the exactness check's draw of messages (a private generator: the training RNG is untouched).
CHECK_SEED = 0
AutocastKey = tuple[bool, torch.dtype | None]


def off_reason(
    model: GPTModel, *, enabled: bool, trainable: Trainable, compiled: bool, processes: int
) -> str | None:
    """Why this run cannot compute its frozen trunk once, or None when it can."""
    if not enabled:
        return "spam.cache_frozen_trunk is false"
    if trainable not in ("head", "last_blocks"):
        return f"trainable: {trainable} trains weights in every block"
    if compiled:
        return "train.compile compiles the whole model into the step"
    if processes > 1:
        return f"torchrun runs {processes} processes"
    trunk = _trunk_modules(model, first_trainable_block(model))
    if any(p.requires_grad for module in trunk for p in module.parameters()):
        return "the embeddings train"
    rates = [m.p for module in trunk for m in module.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if rates:
        return f"dropout {max(rates):g} in the frozen blocks draws new masks at every pass"
    return None


def spam_trunk(
    model: GPTModel, data: Mapping[str, SpamDataset], cfg: SpamConfig, spill_dir: Path
) -> AbstractContextManager[FrozenTrunk]:
    """The spam stage's trunk: its splits in its loaders' batches (training, then evaluation), at its precision."""
    off = off_reason(
        model,
        enabled=cfg.cache_frozen_trunk,
        trainable=cfg.trainable,
        compiled=cfg.train.compile,
        processes=distributed.world().size,
    )
    return frozen_trunk(
        model,
        {split: dataset.input_ids for split, dataset in data.items()},
        batch_sizes=(cfg.train.batch_size, cfg.train.eval_batch_size or cfg.train.batch_size),
        shuffled="train",
        precision=cfg.train.precision,
        spill_dir=spill_dir,
        off=off,
    )


def first_trainable_block(model: GPTModel) -> int:
    """Index of the lowest block with a trainable weight; the number of blocks when none has one."""
    for index, block in enumerate(model.trf_blocks):
        if any(p.requires_grad for p in block.parameters()):
            return index
    return len(model.trf_blocks)


class FrozenTrunk:
    """The cached trunk states of a run, or none (`cached` False) with the reason, as the stage logs it."""

    def __init__(
        self,
        summary: str,
        first_block: int = 0,
        states: torch.Tensor | None = None,
        slots: Mapping[tuple[int, ...], Mapping[bytes, int]] | None = None,
        autocast_key: AutocastKey | None = None,
    ) -> None:
        self.summary = summary  # "on: ..." or "off: <why>"
        self.first_block = first_block
        self._states = states  # (messages, t, emb), every batch shape's rows together
        self._slots = dict(slots or {})  # batch shape (rows, t) -> token ids' bytes -> row of _states
        self._autocast = autocast_key
        self.hits = self.misses = 0  # batches read from the cache, and batches that ran the whole model
        self.seconds = 0.0  # what computing the states and checking them took

    @property
    def cached(self) -> bool:
        return self._states is not None

    def release(self) -> None:
        """Drop the states (their memory, or their file's mapping): from now on the whole model runs."""
        self._states, self._slots = None, {}

    def view(self, model: GPTModel) -> nn.Module:
        """`model` as the loop and the scores call it: its trainable top on cached states where it can."""
        return _TopView(model, self) if self.cached else model

    def loss(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn` computed on the view of whatever model it is handed (a checkpoint's twin too)."""
        if not self.cached:
            return loss_fn

        def cached_loss(model: nn.Module, batch: Any) -> torch.Tensor:
            assert isinstance(model, GPTModel), "the frozen trunk's loss takes the classifier itself"
            return loss_fn(self.view(model), batch)

        return cached_loss

    def states(self, in_idx: torch.Tensor) -> torch.Tensor | None:
        """The trunk's output (b, t, emb) for token ids (b, t) if this very batch shape was cached, else None."""
        slots = self._slots.get(tuple(in_idx.shape))
        if self._states is None or slots is None or autocast_key(in_idx.device) != self._autocast:
            self.misses += 1
            return None
        rows = [slots.get(row.tobytes()) for row in in_idx.to("cpu", torch.int64).numpy()]
        if None in rows:
            self.misses += 1
            return None
        self.hits += 1
        return self._states[rows].to(in_idx.device)  # a copy, in the rows' order


class _TopView(nn.Module):
    """The classifier reading its frozen trunk's output from the cache: GPTModel.forward from there on."""

    def __init__(self, model: GPTModel, trunk: FrozenTrunk) -> None:
        super().__init__()
        self.model = model
        self.trunk = trunk
        self.training = model.training  # eval() and train() on the view reach the model

    def forward(self, in_idx: torch.Tensor) -> torch.Tensor:
        x = self.trunk.states(in_idx)
        if x is None:
            return self.model(in_idx)
        for block in self.model.trf_blocks[self.trunk.first_block :]:
            x = block(x)
        return self.model.out_head(self.model.final_norm(x))


def autocast_key(device: torch.device) -> AutocastKey:
    """Whether autocast is on for `device` here, and to what dtype: part of a cached batch's key."""
    if not torch.is_autocast_enabled(device.type):
        return False, None
    return True, torch.get_autocast_dtype(device.type)


@dataclass(frozen=True)
class _Batch:
    """One batch as a loader reads it, and where its rows not computed before go in the cache."""

    ids: torch.Tensor  # (rows, t)
    slots: dict[int, int]  # row of the batch -> row of the cache


def plan_batches(
    splits: Mapping[str, torch.Tensor], batch_sizes: tuple[int, ...], shuffled: str
) -> tuple[list[_Batch], dict[tuple[int, ...], dict[bytes, int]]]:
    """The batches to compute, and for each batch shape the cache row of every message computed in it.

    Every split in order in each of `batch_sizes` (evaluation loaders: the last short batch kept);
    the `shuffled` split's last messages again in a full batch of `batch_sizes[0]` (the training
    loader draws every message into one), filled up with its first ones.
    """
    batches: list[_Batch] = []
    slots: dict[tuple[int, ...], dict[bytes, int]] = {}
    count = 0
    for name, ids in splits.items():
        chunks = [chunk for size in dict.fromkeys(batch_sizes) for chunk in ids.split(size)]
        tail = len(ids) % batch_sizes[0]
        if name == shuffled and tail:
            filler = ids[torch.arange(batch_sizes[0] - tail) % len(ids)]
            chunks.append(torch.cat([ids[len(ids) - tail :], filler]))
        for chunk in chunks:
            known = slots.setdefault(tuple(chunk.shape), {})
            new: dict[int, int] = {}
            for row, message in enumerate(chunk.to(torch.int64).numpy()):
                key = message.tobytes()
                if key not in known:
                    known[key] = new[row] = count
                    count += 1
            if new:
                batches.append(_Batch(chunk, new))
    return batches, slots


def trunk_output(model: GPTModel, first_block: int, in_idx: torch.Tensor) -> torch.Tensor:
    """What the blocks from `first_block` on read (b, t, emb): GPTModel.hidden_states up to there."""
    positions = torch.arange(in_idx.shape[1], device=in_idx.device)
    x = model.drop_emb(model.tok_emb(in_idx) + model.pos_emb(positions))  # (b, t, emb)
    for block in model.trf_blocks[:first_block]:
        x = block(x)
    return x


@contextmanager
def frozen_trunk(
    model: GPTModel,
    splits: Mapping[str, torch.Tensor],
    *,
    batch_sizes: tuple[int, ...],
    shuffled: str,
    precision: Precision,
    spill_dir: Path,
    off: str | None,
    memory_limit: int | None = None,
) -> Iterator[FrozenTrunk]:
    """The trunk of `model` computed once for the token ids of every split (n, t), for the block.

    `batch_sizes`: the loaders' batches, the training one first; `shuffled`: the split the
    training loader shuffles. `off`: why not to (the `off_reason`), or None. The states live
    in memory, or in a memory-mapped temporary file under `spill_dir` beyond `memory_limit`
    bytes (default: a quarter of the machine's memory), which never outlives the block.
    """
    if off is not None:
        yield FrozenTrunk(f"off: {off}")
        return
    started = time.perf_counter()
    first = first_trainable_block(model)
    device = next(model.parameters()).device
    batches, slots = plan_batches(splits, batch_sizes, shuffled)
    with autocast(device, precision):
        key = autocast_key(device)
        states, where = _compute(model, first, batches, spill_dir, memory_limit)
        size = f"{len(states):,} message states, {_megabytes(states.nbytes)} {where}"
        trunk = FrozenTrunk(f"on: {_trunk_name(first)} computed once ({size})", first, states, slots, key)
        if not _same_as_whole_model(model, trunk, splits[shuffled], batch_sizes[0]):
            trunk = FrozenTrunk(
                "off: the cached states differ from the whole model's on a check batch "
                "(this machine's kernels depend on a batch's other rows)"
            )
    trunk.seconds = time.perf_counter() - started
    try:
        yield trunk
    finally:
        trunk.release()


def _trunk_name(first_block: int) -> str:
    blocks = {0: "", 1: " and block 0"}.get(first_block, f" and blocks 0-{first_block - 1}")
    return f"the embeddings{blocks}"


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _trunk_modules(model: GPTModel, first_block: int) -> list[nn.Module]:
    return [model.tok_emb, model.pos_emb, model.drop_emb, *model.trf_blocks[:first_block]]


@torch.no_grad()
def _compute(
    model: GPTModel,
    first_block: int,
    batches: list[_Batch],
    spill_dir: Path,
    memory_limit: int | None,
) -> tuple[torch.Tensor, str]:
    """Every planned batch through the trunk, its new rows stored; the store and where it lives."""
    rows = sum(len(batch.slots) for batch in batches)
    device = next(model.parameters()).device
    states: torch.Tensor | None = None
    where = "in memory"
    for batch in batches:
        x = trunk_output(model, first_block, batch.ids.to(device))
        if states is None:  # its dtype and size known now: under autocast the trunk's output dtype
            shape = (rows, *x.shape[1:])
            states, where = _allocate(shape, x.dtype, spill_dir, memory_limit)
        targets = list(batch.slots.values())
        states[targets] = x[list(batch.slots)].cpu()
    assert states is not None, "the training split holds at least one batch"
    return states, where


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, spill_dir: Path, memory_limit: int | None
) -> tuple[torch.Tensor, str]:
    """An empty store: in memory, or memory-mapped from a temporary file when it is large for this machine."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    limit = memory_limit if memory_limit is not None else _memory_bytes() // RAM_SHARE
    if nbytes <= limit:
        return torch.empty(shape, dtype=dtype), "in memory"
    spill_dir.mkdir(parents=True, exist_ok=True)
    # Unnamed (or unlinked) at once: the mapping outlives the file's name, nothing is left behind,
    # even after kill -9, and the space is freed with the states.
    with tempfile.TemporaryFile(dir=spill_dir, prefix="frozen-trunk-") as file:
        mapped = np.memmap(file, dtype=np.uint8, mode="w+", shape=(nbytes,))
    return torch.from_numpy(mapped).view(dtype).view(shape), f"memory-mapped under {spill_dir}"


def _memory_bytes() -> int:
    """The machine's physical memory; unknown counts as unlimited (the store stays in memory)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return sys.maxsize


@torch.no_grad()
def _same_as_whole_model(model: GPTModel, trunk: FrozenTrunk, ids: torch.Tensor, rows: int) -> bool:
    """Whether messages drawn from across the cached batches give the whole model's logits bit for bit."""
    pick = torch.randperm(len(ids), generator=torch.Generator().manual_seed(CHECK_SEED))[:rows]
    batch = ids[pick].to(next(model.parameters()).device)
    cached = trunk.view(model)(batch)
    assert trunk.hits == 1, "every training message is cached in a batch of the training size"
    trunk.hits = 0
    return torch.equal(cached, model(batch))
