"""The decoding steps of `generate` for a fused model: one new token a row through plain tensor calls.

A decoding step multiplies one token per row by every weight, so its time is
reading the weights (~500 MB for GPT-2 small at fp32) plus, through the
modules, ~140 module calls and layout checks a token in Python. `FusedDecoder`
runs each block's decoding step (`_BlockStep`: TransformerBlock's forward in
eval mode, written once more) on what the modules hand over: the attention's
fused (in, out) projection (`decoding_qkv`), each DecodeLinear's
(`decoding_projection`), its own attention kernel (`attend`) and its norms and
GELU as they are. The same operations in the same order as the modules' own
decoding path, so its logits and tokens are bit for bit the modules'
(tests/model/test_decoding.py); it only leaves the module machinery out: on the
AVX2 CPU measured, 100 greedy tokens of GPT-2 small ran 1.27x transformers'
`generate` against 1.13x before (benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from gptlab.model.fast_kernels import DecodeLinear, DecodeProjection, FusedQKVAttention, is_decoding_step
from gptlab.model.gpt import GPTModel, TransformerBlock
from gptlab.model.kv_cache import KVCache, LayerKVCache

Layer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class _BlockStep:
    """TransformerBlock.forward in eval mode (dropout is the identity) for one new token a row."""

    norm1: Layer
    qkv: DecodeProjection  # queries, keys and values side by side: (emb, 3 * emb)
    heads: int
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    out_proj: Layer
    norm2: Layer
    feed_forward: tuple[Layer, ...]  # its layers in order

    def __call__(self, x: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
        b, t, emb = x.shape  # (b, 1, emb)
        shortcut = x
        queries, keys, values = self.qkv(self.norm1(x)).split(emb, dim=-1)  # 3 x (b, 1, emb)
        # (b, 1, emb) -> (b, 1, heads, head_dim) -> (b, heads, 1, head_dim)
        queries, keys, values = (
            y.view(b, t, self.heads, -1).transpose(1, 2) for y in (queries, keys, values)
        )
        keys, values = cache.append(keys, values)  # (b, heads, past + 1, head_dim)
        context = self.attend(queries, keys, values, cache.allowed)  # (b, heads, 1, head_dim)
        # (b, heads, 1, head_dim) -> (b, 1, heads, head_dim) -> (b, 1, emb)
        context = context.transpose(1, 2).contiguous().view(b, t, emb)
        x = self.out_proj(context) + shortcut
        shortcut = x
        x = self.norm2(x)
        for layer in self.feed_forward:
            x = layer(x)
        return x + shortcut


class FusedDecoder:
    """A model's decoding steps past its modules, on weights gathered once per `generate` call.

    The weights cannot change within a call; the next call's decoder gathers them anew.
    """

    def __init__(self, model: GPTModel) -> None:
        self.model = model

    def takes(self, ids: torch.Tensor) -> bool:
        """Whether new tokens `ids` (b, 1) skip the modules: a decoding step, eval mode, all blocks fused."""
        return not self.model.training and is_decoding_step(ids) and self._steps is not None

    def hidden_states(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`model.hidden_states(ids, cache)`, bit for bit, for one new token a row: (b, 1) -> (b, 1, emb)."""
        if not self.takes(ids):
            return self.model.hidden_states(ids, cache)
        model = self.model
        x = model.tok_emb(ids) + model.pos_emb(cache.start(ids.shape[1], ids.device))  # (b, 1, emb)
        for step, layer in zip(self._steps, cache.layers, strict=True):
            x = step(x, layer)
        return model.final_norm(x)

    @cached_property
    def _steps(self) -> list[_BlockStep] | None:
        """Each block's decoding step, gathered at the first (a call may take none); None if one has none."""
        steps = [_block_step(block) for block in self.model.trf_blocks]
        return None if any(step is None for step in steps) else steps


def _block_step(block: TransformerBlock) -> _BlockStep | None:
    """The block's decoding step, on what its modules hand over; None unless its attention fuses Q/K/V."""
    att = block.att
    qkv = att.decoding_qkv() if isinstance(att, FusedQKVAttention) else None
    if qkv is None:
        return None
    return _BlockStep(
        norm1=block.norm1,
        qkv=qkv,
        heads=att.num_heads,
        attend=att.attend,
        out_proj=_layer(att.out_proj),
        norm2=block.norm2,
        feed_forward=tuple(_layer(module) for module in block.ff.layers),
    )


def _layer(module: nn.Module) -> Layer:
    """A DecodeLinear as its decoding steps compute it, without the module call; any other module as it is."""
    return module.decoding_projection() if type(module) is DecodeLinear else module
