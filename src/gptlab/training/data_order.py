"""`train.rng`: in what order training reads its data, and where randomness is drawn.

Two protocols, and everything that depends on which one runs:

- `book` (the default) draws as the book's scripts do: a shuffled training
  loader and a validation loader without generators, so every pass over them
  (training epochs, evaluations, chapter 6's accuracies) draws from the global
  RNG, which the stage seeds where the chapter does. Same params, same numbers
  as the book's own code on the same machine. A run resumed mid-epoch restores
  the RNG state the epoch began with, draws the same order again and skips the
  batches already trained on.
- `per_epoch` draws the order of epoch e from its own generator seeded with
  `seed + e`, evaluates in data order, seeds the global RNG (dropout) itself,
  and keeps end-of-epoch callbacks from shifting it: the scheme torchrun uses,
  rank r taking every world_size-th batch of the same order.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from gptlab.model.checkpoint import Progress
from gptlab.training.config import TrainConfig
from gptlab.training.distributed import World
from gptlab.training.runtime import ordered_loader

Collate = Callable[[list[Any]], Any] | None


class DataOrder:
    """The batches of each training epoch and what evaluations read, under one protocol.

    The book's draws assume one process, so under torchrun the protocol is per_epoch.
    """

    def __init__(
        self, train_data: Dataset, val_data: Dataset, cfg: TrainConfig, world: World, collate_fn: Collate
    ) -> None:
        self.protocol = cfg.rng if world.size == 1 else "per_epoch"
        self.train_data, self.cfg, self.world, self.collate_fn = train_data, cfg, world, collate_fn
        # With eval_in_one_pass, one batch holds what eval_iter batches would (per_epoch: the same examples).
        one_pass = cfg.eval_in_one_pass and self.protocol == "per_epoch"
        eval_batch = cfg.batch_size * cfg.eval_iter if one_pass else cfg.batch_size
        self.eval_batches = 1 if one_pass else cfg.eval_iter  # batches an evaluation reads of each split
        self.train_eval = evaluation_loader(train_data, eval_batch, self.protocol, True, collate_fn)
        self.val_eval = evaluation_loader(val_data, eval_batch, self.protocol, False, collate_fn)

    def start_afresh(self) -> None:
        """Seed a run that resumes nothing; under `book` the stage has seeded where the chapter does."""
        if self.protocol == "per_epoch":
            seed_everything(self.cfg.seed + self.world.rank)  # other dropout masks on each rank

    def epoch_batches(self, progress: Progress) -> Iterator[Any]:
        """The rest of the epoch in progress: its batches after the `progress.batch` already trained on."""
        if self.protocol == "book":
            return _book_epoch(self.train_eval, progress)
        order = rank_order(
            epoch_order(len(self.train_data), self.cfg.seed, progress.epoch),  # type: ignore[arg-type]
            self.cfg.batch_size,
            self.world,
        )
        return iter(
            DataLoader(
                self.train_data,
                batch_size=self.cfg.batch_size,
                sampler=order[progress.batch * self.cfg.batch_size :],
                drop_last=True,
                collate_fn=self.collate_fn,
                generator=torch.Generator(),
            )
        )

    def callback_rng(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Around an end-of-epoch callback: its draws count under `book` (as the book's), not under per_epoch."""
        return forked_rng(device) if self.protocol == "per_epoch" else contextlib.nullcontext()


def evaluation_loader(
    dataset: Dataset, batch_size: int, protocol: str, shuffled: bool, collate_fn: Collate = None
) -> DataLoader:
    """What evaluation (and the stages' per-epoch scores) read of a split under `train.rng`.

    book: the book's own loaders, with no generator, so each pass draws from the
    global RNG as the book's do: the training split shuffled with drop_last (the
    very loader it trains on), the others in order. per_epoch: in data order,
    on a private generator.
    """
    if protocol == "book":
        return DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffled, drop_last=shuffled, collate_fn=collate_fn
        )
    return ordered_loader(dataset, batch_size, collate_fn)


def _book_epoch(train_loader: DataLoader, progress: Progress) -> Iterator[Any]:
    """This epoch's batches from the book's shuffled loader, replayed up to where a resumed run stopped.

    Iterating the loader draws its order from the global RNG, so the RNG state
    as the epoch began is kept; a run resumed mid-epoch restores it, draws the
    same order, skips the batches already trained on, and goes on from the
    RNG state saved at its last step.
    """
    if progress.batch == 0:
        progress.epoch_rng = rng_state()
        return iter(train_loader)
    assert progress.epoch_rng is not None, "a checkpoint taken mid-epoch keeps the epoch's RNG state"
    at_step = rng_state()
    set_rng_state(progress.epoch_rng)
    batches = iter(train_loader)
    for _ in range(progress.batch):
        next(batches)
    set_rng_state(at_step)
    return batches


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The shuffled example order of one epoch, a pure function of (seed, epoch)."""
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def rank_order(order: list[int], batch_size: int, world: World) -> list[int]:
    """This rank's share of an epoch order: every world.size-th batch, starting at batch world.rank.

    All ranks get the same number of whole batches (the remainder is dropped);
    with one process the order is returned as it is.
    """
    if world.size == 1:
        return order
    steps = len(order) // batch_size // world.size
    batches = range(world.rank, steps * world.size, world.size)
    return [i for b in batches for i in order[b * batch_size : (b + 1) * batch_size]]


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values, so torch.load(weights_only=True) reads it."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    random.setstate(state["python"])


def forked_rng(device: torch.device) -> Any:
    """A block whose use of torch's RNG (CPU and the training GPU) is undone when it ends."""
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])
