"""LoRA, low-rank adaptation, as appendix E of the book builds it.

Every `nn.Linear` of the model (the attention projections, the feed-forward
layers and the output head) is replaced by a `LinearWithLoRA`: the frozen
original layer plus a trainable `LoRALayer`, whose output
`(alpha / rank) * (x @ A @ B)` is added to the layer's. A is drawn as
`nn.Linear` draws its weights (`kaiming_uniform_(a=sqrt(5))`, on the CPU
generator, as the book's model is built on the CPU) and B starts at zero, so
before training the model computes exactly what it did without LoRA.

The scale is the printed book's (listing E.5): alpha divided by the rank, 1 with
its rank 16 and alpha 16. (The book repository's chapter 6 bonus script scales
by alpha alone; its `--lora_rank 16 --lora_alpha 16` is rank 16, alpha 256 here.)

The layers are swapped by module replacement (`replace_linear_with_lora`, named
as in the book), so the model's own classes stay as the book's; code that looks
for plain `nn.Linear` projections (fast kernels) sees the wrapper and takes the
general path. `merge_lora` folds each adapter into its layer's weight,
W + (alpha / rank) * (A @ B)^T, giving back a model of plain `nn.Linear` layers
with GPT-2's tensor names: what the stages save, so every reader of a checkpoint
(classify, chat, export, the MLflow models) works unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALayer(nn.Module):
    """The low-rank update of one layer: (alpha / rank) * (x @ A @ B), A (in, rank), B (rank, out)."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {rank}")
        self.A = nn.Parameter(torch.empty(in_dim, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # nn.Linear's own initialisation
        self.B = nn.Parameter(torch.zeros(rank, out_dim))
        self.rank = rank
        self.alpha = alpha

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * (x @ self.A @ self.B)

    def delta_weight(self) -> torch.Tensor:
        """The update as an nn.Linear weight (out, in), computed in float64."""
        return (self.scale * (self.A.double() @ self.B.double())).T

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


class LinearWithLoRA(nn.Module):
    """A frozen `nn.Linear` plus its trainable LoRA update."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.linear = linear
        # Drawn on the CPU as the book's model is built there (same A on every device), then moved.
        self.lora = LoRALayer(linear.in_features, linear.out_features, rank, alpha).to(
            device=linear.weight.device, dtype=linear.weight.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.lora(x)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function: W + (alpha / rank) * (A @ B)^T, bias kept."""
        weight = self.linear.weight
        linear = nn.Linear(
            self.linear.in_features,
            self.linear.out_features,
            bias=self.linear.bias is not None,
            device="meta",
        )
        merged_weight = (weight.double() + self.lora.delta_weight()).to(weight.dtype)
        linear.weight = nn.Parameter(merged_weight, requires_grad=False)
        if self.linear.bias is not None:
            linear.bias = nn.Parameter(self.linear.bias.detach().clone(), requires_grad=False)
        return linear


def replace_linear_with_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Wrap every nn.Linear below `model` in a LinearWithLoRA, in module order (in place; returns it).

    As the book's function: it recurses through the children and does not touch the
    weights it wraps. Freezing is the caller's: see `add_lora`.
    """
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            setattr(model, name, LinearWithLoRA(module, rank, alpha))
        else:
            replace_linear_with_lora(module, rank, alpha)
    return model


def add_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Freeze every parameter of `model`, then wrap each nn.Linear with LoRA: only A and B train.

    The book's order (appendix E): freeze the model, then replace the layers, whose new
    A and B are created trainable. A is drawn from the global (CPU) RNG, layer by layer.
    """
    if has_lora(model):
        raise ValueError("the model already has LoRA layers")
    model.requires_grad_(False)
    with torch.device("cpu"):  # A's draws from the CPU generator, as the book's (torch.device may be set)
        replace_linear_with_lora(model, rank, alpha)
    return model


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(module, LinearWithLoRA) for module in model.modules())


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its layer (in place; returns the model): plain nn.Linear layers again.

    The result computes the same function up to float rounding, and its state dict has the
    names of the model without LoRA, so it saves and loads as an ordinary checkpoint.
    """
    for name, module in model.named_children():
        if isinstance(module, LinearWithLoRA):
            setattr(model, name, module.merged())
        else:
            merge_lora(module)
    return model


def lora_parameter_count(model: nn.Module) -> int:
    """Parameters of the LoRA layers (A and B) of `model`."""
    return sum(
        p.numel() for module in model.modules() if isinstance(module, LoRALayer) for p in module.parameters()
    )
