"""Losses shared by the stages, named by what they compute, and their averages over data.

`next_token_loss` is the book's `calc_loss_batch` (chapters 5 and 7) and
`average_loss` its `calc_loss_loader`. The classification loss of chapter 6
lives beside the classifier, the DPO loss of the chapter 7 bonus beside its
task; all of them plug into `gptlab.training.loop.fit`. A loss function returns
the loss, or a mapping with the loss under "loss" and figures the evaluations
average beside it (DPO's rewards): `average_terms`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from gptlab.training.runtime import Precision, autocast, ordered_loader, to_device

IGNORE_INDEX = -100

LossFn = Callable[[nn.Module, Any], torch.Tensor | Mapping[str, torch.Tensor]]


def loss_terms(output: torch.Tensor | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A loss function's output as named terms: {"loss": ...} for a bare loss."""
    return output if isinstance(output, Mapping) else {"loss": output}


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy of predicting every target token; targets equal to -100 are skipped."""
    inputs, targets = batch
    logits = model(inputs)  # (b, t, vocab)
    # (b, t, vocab) -> (b * t, vocab) against (b, t) -> (b * t,)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


@torch.inference_mode()
def average_terms(
    model: nn.Module, loader: Iterable[Any], loss_fn: LossFn, num_batches: int | None = None
) -> dict[str, float]:
    """Mean of each of `loss_fn`'s terms over the first `num_batches` batches (all when None).

    Like the book's calc_loss_loader (and the DPO notebook's compute_dpo_loss_loader) it
    averages per-batch means, and it leaves the model's train/eval mode to the caller.
    Batches go to the model's device. No batches: {"loss": nan}.
    """
    if isinstance(loader, Sized) and len(loader) == 0:
        return {"loss": math.nan}  # as the book: an empty loader is not even iterated (no RNG draw)
    device = next(model.parameters()).device
    totals: dict[str, float] = {}
    count = 0
    for batch in loader:
        if num_batches is not None and count >= num_batches:
            break
        for name, value in loss_terms(loss_fn(model, to_device(batch, device))).items():
            totals[name] = totals.get(name, 0.0) + value.item()
        count += 1
    return {name: total / count for name, total in totals.items()} if count else {"loss": math.nan}


def average_loss(
    model: nn.Module, loader: Iterable[Any], loss_fn: LossFn, num_batches: int | None = None
) -> float:
    """Mean loss over the first `num_batches` batches (all when None); nan for no batches (`average_terms`)."""
    return average_terms(model, loader, loss_fn, num_batches)["loss"]


def dataset_loss(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int,
    *,
    loss_fn: LossFn = next_token_loss,
    precision: Precision = "fp32",
    collate_fn: Callable[[list[Any]], Any] | None = None,
    desc: str | None = None,
) -> float:
    """Mean loss over every batch of `dataset` in order, in eval mode (no dropout); the mode is restored.

    With `desc`, a progress bar of that name shows while it runs.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loader = ordered_loader(dataset, batch_size, collate_fn)
    batches = tqdm(loader, desc=desc, leave=False, file=sys.stderr, disable=desc is None)
    with autocast(device, precision):
        loss = average_loss(model, batches, loss_fn)
    model.train(was_training)
    return loss


def split_losses(
    model: nn.Module, datasets: Mapping[str, Dataset], batch_size: int, desc: str | None = None
) -> dict[str, float]:
    """`{split}_loss` and `{split}_perplexity` over every window of each split, in order (chapter 5's evaluation)."""
    metrics: dict[str, float] = {}
    for split, dataset in datasets.items():
        loss = dataset_loss(model, dataset, batch_size, desc=desc and f"{desc} {split} loss")
        metrics[f"{split}_loss"] = loss
        metrics[f"{split}_perplexity"] = perplexity(loss)
    return metrics


def perplexity(loss: float) -> float:
    """exp(loss), the book's perplexity; inf where exp would overflow a float (beyond ~709)."""
    return math.exp(loss) if loss < 700 else math.inf
