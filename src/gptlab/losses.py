"""Losses shared by the training stages, named by what they compute.

`next_token_loss` is the book's `calc_loss_batch` (chapters 5 and 7) and
`average_loss` its `calc_loss_loader`. The classification loss of chapter 6
lives beside the classifier; all of them plug into `gptlab.train.fit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy of predicting every target token; targets equal to -100 are skipped."""
    inputs, targets = batch
    logits = model(inputs)  # (b, t, vocab)
    # (b, t, vocab) -> (b * t, vocab) against (b, t) -> (b * t,)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor moved to `device` (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


@torch.no_grad()
def average_loss(
    model: nn.Module, loader: Iterable[Any], loss_fn: LossFn, num_batches: int | None = None
) -> float:
    """Mean of `loss_fn` over the first `num_batches` batches (all when None); nan for no batches.

    Like the book's calc_loss_loader it averages per-batch means, and it leaves
    the model's train/eval mode to the caller. Batches go to the model's device.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in loader:
        if num_batches is not None and count >= num_batches:
            break
        total += loss_fn(model, to_device(batch, device)).item()
        count += 1
    return total / count if count else math.nan
