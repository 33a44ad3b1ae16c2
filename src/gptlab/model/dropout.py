"""Dropout whose mask costs a fraction of torch's on the CPU (`kernels: fused`, see fast_kernels.py).

On the CPU (on AMD ones, where torch does not hand it to MKL) torch draws a
dropout mask one element at a time (`bernoulli_`, ~7 ns an element on 2 cores:
about 9 % of a GPT-2 training step, most of it the attention weights). This
mask takes 64 random bits per four elements from the same seeded generator and
keeps an element where its 16 bits reach p * 2^16: dropout with p rounded to a
multiple of 2^-16 (0.1 becomes 0.100006), about 4x cheaper. On other devices
torch's own dropout is already parallel and stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PIECES = 4  # 16-bit pieces of one 64-bit draw


def keep_mask(shape: torch.Size, p: float) -> torch.Tensor:
    """A (shape) bool mask on the CPU, each element True with probability 1 - p (p to 2^-16)."""
    count = shape.numel()
    bits = torch.empty((count + _PIECES - 1) // _PIECES, dtype=torch.int64).random_(-(2**63), None)
    pieces = bits.view(torch.int16)[:count]  # uniform over [-2^15, 2^15)
    return (pieces >= round(p * 2**16) - 2**15).view(shape)


def uses_keep_mask(x: torch.Tensor, p: float, training: bool) -> bool:
    """Whether dropping from x draws keep_mask: in training, on the CPU, eager (compiled code draws its own)."""
    return training and 0.0 < p < 1.0 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout(x, p, training), its mask drawn by keep_mask where uses_keep_mask."""
    if not uses_keep_mask(x, p, training):
        return F.dropout(x, p, training)
    return (x * keep_mask(x.shape, p)).mul_(1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """nn.Dropout (same p, no state) drawing its masks with keep_mask on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
