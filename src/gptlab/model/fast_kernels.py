"""The speed paths of the book's GPT-2 (gpt.py): stand-ins for its modules, same maths, same parameters.

Two settings choose them, each with the same maths and parameter names as the book:

- `attention: sdpa` computes attention with torch's `scaled_dot_product_attention`
  instead of the book's masked softmax (`masked_softmax`).
- `kernels: fused` (against `book`) uses torch's layer norm and tanh-GELU kernels,
  one matmul for the queries, keys and values, decoding steps against weights
  laid out (in, out), and dropout masks drawn 16 bits an element (dropout.py).

They plug in by module replacement, as LoRA does: build.py's `build_gpt` builds
the book's model, so that the random weights are the book's whatever the settings
(seed, then build), and `with_kernels` swaps its modules for subclasses holding the
same parameters, built on the meta device so nothing is drawn twice. The model stays
a GPTModel with the book's parameter names: checkpoints load unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.model.dropout import Dropout, uses_keep_mask
from gptlab.model.gpt import GELU, LayerNorm, MultiHeadAttention

# Rows up to which a CPU matmul is a decoding step: one token per sequence, a batch of one or two.
DECODE_ROWS = 2

M = TypeVar("M", bound=nn.Module)


def with_kernels(module: M, kernels: str, attention: str) -> M:
    """`module` (in place where it can) with the book's modules below it, itself included, swapped for
    the speed paths that `kernels` (book or fused) and `attention` (masked_softmax or sdpa) name.

    Each stand-in is a subclass of the module it replaces and holds its parameters and
    submodules; LoRA's wrappers and modules already swapped are left as they are.
    """
    replacement = _replacement(module, kernels, attention)
    if replacement is not None:
        module = _holding(replacement, module)
    for name, child in module.named_children():
        setattr(module, name, with_kernels(child, kernels, attention))
    return module


def _replacement(module: nn.Module, kernels: str, attention: str) -> nn.Module | None:
    """A fresh stand-in for `module`, built on the meta device (nothing drawn, no memory); None keeps it."""
    fused = kernels == "fused"
    with torch.device("meta"):
        if type(module) is MultiHeadAttention:
            attention_class = _attention_class(fused, sdpa=attention == "sdpa")
            if attention_class is MultiHeadAttention:
                return None
            projection = module.W_query
            return attention_class(
                projection.in_features,
                module.d_out,
                module.dropout.p,
                module.num_heads,
                qkv_bias=projection.bias is not None,
            )
        if not fused:
            return None
        if type(module) is nn.Linear:
            return DecodeLinear(module.in_features, module.out_features, bias=module.bias is not None)
        if type(module) is LayerNorm:
            return FusedLayerNorm(module.scale.shape[0], module.eps)
        if type(module) is GELU:
            return FusedGELU()
        if type(module) is nn.Dropout:
            return Dropout(module.p)
    return None


def _attention_class(fused: bool, sdpa: bool) -> type[MultiHeadAttention]:
    if fused:
        return FusedQKVSdpaAttention if sdpa else FusedQKVAttention
    return SdpaAttention if sdpa else MultiHeadAttention


def _holding(replacement: M, module: nn.Module) -> M:
    """`replacement` holding `module`'s parameters and submodules (same names, same order), in its mode."""
    for name, parameter in module.named_parameters(recurse=False):
        setattr(replacement, name, parameter)
    for name, child in module.named_children():
        setattr(replacement, name, child)
    replacement.training = module.training  # the submodules keep their own
    return replacement


class FusedLayerNorm(LayerNorm):
    """The book's LayerNorm in torch's one kernel instead of six element-wise passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.scale.shape, self.scale, self.shift, self.eps)


class FusedGELU(GELU):
    """The book's tanh-approximated GELU in torch's one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class DecodeWeight:
    """Weights (out_i, in) side by side and transposed to (in, sum out_i), remade whenever one changes.

    A matrix-vector product against the (in, out) layout runs ~1.3x faster on CPUs than
    against nn.Linear's (out, in) (it is how Hugging Face's GPT-2 stores its weights), so
    decoding steps use this copy. A change to a weight (an optimizer step, a load, a move)
    bumps its version or its storage, and the next call copies again, into the same
    memory where it can (a fresh copy of GPT-2 small's weights costs its page faults:
    a training stage's epoch-end sample took ~0.3 s longer).
    """

    def __init__(self) -> None:
        self.key: tuple[tuple[int, int], ...] = ()
        self.weight: torch.Tensor | None = None

    def of(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        key = tuple((w.data_ptr(), w._version) for w in weights)
        if self.weight is None or key != self.key:
            self.weight = self._transposed(weights)
            self.key = key
        return self.weight

    def _transposed(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        first = weights[0]
        shape = (first.shape[1], sum(w.shape[0] for w in weights))
        fits = self.weight is not None and self.weight.shape == shape
        if not (fits and self.weight.dtype == first.dtype and self.weight.device == first.device):
            return torch.cat([w.detach() for w in weights]).t().contiguous()
        start = 0
        for w in weights:
            self.weight[:, start : start + w.shape[0]].copy_(w.detach().t())
            start += w.shape[0]
        return self.weight


def is_decoding_step(x: torch.Tensor) -> bool:
    """Whether x (rows..., in) is a decoding step: a few rows at inference, without autocast, on the CPU.

    The one place that decides it: the fused modules then multiply against their
    DecodeWeight copies, where they pay, and FusedDecoder takes such steps past the
    modules. A step's new ids (b, 1) count b rows, as their embeddings (b, 1, emb) do.
    """
    return (
        x.device.type == "cpu"
        and x.shape[:-1].numel() <= DECODE_ROWS
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


@dataclass(frozen=True, eq=False)
class DecodeProjection:
    """A linear layer as its decoding steps compute it: x @ W.T + b, with W.T laid out (in, out)."""

    weight_t: torch.Tensor  # (in, out): a DecodeWeight copy
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (..., in) -> (rows, in)
        out = rows @ self.weight_t if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)
        return out.view(*x.shape[:-1], -1)  # (rows, out) -> (..., out)


class DecodeLinear(nn.Linear):
    """nn.Linear (same initialisation, same parameters) whose decoding steps use a DecodeWeight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._decode_weight = DecodeWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_decoding_step(x):
            return self.decoding_projection()(x)
        return F.linear(x, self.weight, self.bias)

    def decoding_projection(self) -> DecodeProjection:
        """What its decoding steps multiply by: its weight's (in, out) copy, kept up to date, and its bias."""
        return DecodeProjection(self._decode_weight.of([self.weight]), self.bias)


class SdpaAttention(MultiHeadAttention):
    """The book's attention computed by torch's scaled_dot_product_attention (`attention: sdpa`)."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        dropout_p = self.dropout.p if self.training else 0.0
        if isinstance(self.dropout, Dropout) and uses_keep_mask(q, dropout_p, self.training):
            # On the CPU, SDPA with dropout computes these same steps (its math path), its mask by
            # torch's element-at-a-time bernoulli_; the masked softmax draws it with keep_mask.
            if allowed is None:
                return self.biased_softmax(q, k, v)
            return super().attend(q, k, v, allowed)
        if allowed is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        # One query (a step after the cached keys) sees every key: no mask at all.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=q.shape[2] > 1)

    def biased_softmax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The causal masked softmax with the mask and the 1/√d scale inside the scores' matmul.

        One baddbmm adds a -inf bias above the diagonal and scales by alpha, instead of
        the scores' two extra passes (masked_fill_, division) and the division's backward. One
        GPT-2 small attention layer's forward and backward took 1.7 ms less at bf16 (5 %) and
        0.7 ms at fp32 on the CPU measured (benchmarks/README.md).
        """
        b, heads, t, head_dim = q.shape
        above = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(diagonal=1)  # later keys
        bias = torch.zeros(t, t, device=q.device).masked_fill_(above, -torch.inf)
        attn_scores = torch.baddbmm(
            bias,
            q.reshape(b * heads, t, head_dim),
            k.reshape(b * heads, t, head_dim).transpose(1, 2),
            alpha=1 / head_dim**0.5,
        )  # (b * heads, t, t)
        attn_weights = self.dropout(torch.softmax(attn_scores.view(b, heads, t, t), dim=-1))
        return attn_weights @ v  # (b, heads, t, head_dim)


class FusedQKVAttention(MultiHeadAttention):
    """The book's attention with its queries, keys and values from one matmul (`kernels: fused`).

    Fused only while the three projections are DecodeLinears (LoRA, for one,
    replaces them with its own modules): otherwise the book's three matmuls.
    """

    def __init__(self, d_in: int, d_out: int, dropout: float, num_heads: int, qkv_bias: bool = False) -> None:
        super().__init__(d_in, d_out, dropout, num_heads, qkv_bias)
        self._decode_qkv = DecodeWeight()

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of x, each (b, t, d_out), from one matmul."""
        if is_decoding_step(x) and (qkv := self.decoding_qkv()) is not None:
            return qkv(x).split(self.d_out, dim=-1)  # (b, t, 3 * d_out) -> 3 x (b, t, d_out)
        projections = self._fused_projections()
        if projections is None:
            return super().project_qkv(x)
        weight = torch.cat([p.weight for p in projections])  # (3 * d_out, d_in)
        return F.linear(x, weight, _joined_bias(projections)).split(self.d_out, dim=-1)

    def decoding_qkv(self) -> DecodeProjection | None:
        """The one projection its decoding steps compute queries, keys and values with, (d_in, 3 * d_out).

        The three weights' (in, out) copy side by side, brought up to date, and their
        biases; None where the projections are not fused.
        """
        projections = self._fused_projections()
        if projections is None:
            return None
        return DecodeProjection(
            self._decode_qkv.of([p.weight for p in projections]), _joined_bias(projections)
        )

    def _fused_projections(self) -> tuple[DecodeLinear, ...] | None:
        projections = (self.W_query, self.W_key, self.W_value)
        return projections if all(type(p) is DecodeLinear for p in projections) else None


def _joined_bias(projections: Sequence[nn.Linear]) -> torch.Tensor | None:
    """The projections' biases side by side, (sum out_i,), as their weights are; None without biases."""
    return None if projections[0].bias is None else torch.cat([p.bias for p in projections])


class FusedQKVSdpaAttention(FusedQKVAttention, SdpaAttention):
    """Both: one matmul for the queries, keys and values, and scaled_dot_product_attention."""
