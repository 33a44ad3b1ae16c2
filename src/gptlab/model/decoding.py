"""The decoding steps of `generate` for a fused model: one new token a row through plain tensor calls.

A decoding step multiplies one token per row by every weight, so its time is
reading the weights (~500 MB for GPT-2 small at fp32) plus, through the
modules, ~140 module calls and layout checks a token in Python. `FusedDecoder`
runs the same operations on the same (in, out) weight copies
(`fast_kernels.DecodeWeight`) in the same order as the modules' own decoding path, so
its logits and tokens are bit for bit the modules'; it only leaves the module
machinery out: on the AVX2 CPU measured, 100 greedy tokens of GPT-2 small ran
1.27x transformers' `generate` against 1.13x before (benchmarks/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlab.model.fast_kernels import (
    DecodeLinear,
    FusedQKVSdpaAttention,
    decode_linear,
    is_decoding_step,
)
from gptlab.model.gpt import GELU, GPTModel, LayerNorm
from gptlab.model.kv_cache import KVCache


@dataclass(frozen=True)
class _Projection:
    weight_t: torch.Tensor  # (in, out): the DecodeWeight copy
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, self.weight_t, self.bias)


@dataclass(frozen=True)
class _Block:
    norm1: LayerNorm
    qkv: _Projection  # queries, keys and values side by side
    out_proj: _Projection
    norm2: LayerNorm
    ff_in: _Projection
    gelu: GELU
    ff_out: _Projection


class FusedDecoder:
    """A fused model's decoding steps, its weights gathered once per `generate` call (they cannot change in it)."""

    def __init__(self, model: GPTModel) -> None:
        self.model = model
        self.blocks: list[_Block] = []  # gathered at the first step: a call may never take one

    def _gather(self) -> None:
        model = self.model
        for block in model.trf_blocks:
            att, ff = block.att, block.ff.layers
            projections = (att.W_query, att.W_key, att.W_value)
            qkv_bias = None if att.W_query.bias is None else torch.cat([p.bias for p in projections])
            self.blocks.append(
                _Block(
                    norm1=block.norm1,
                    qkv=_Projection(att.decode_qkv.of([p.weight for p in projections]), qkv_bias),
                    out_proj=_projection(att.out_proj),
                    norm2=block.norm2,
                    ff_in=_projection(ff[0]),
                    gelu=ff[1],
                    ff_out=_projection(ff[2]),
                )
            )

    @staticmethod
    def fits(model: GPTModel, idx: torch.Tensor) -> bool:
        """Whether the modules would decode the new tokens of `idx` (b, t) by their decoding path, which this replaces.

        That path: fused kernels, SDPA, plain Linears, in eval mode, and a decoding step (b rows).
        """
        linears = [
            m
            for block in model.trf_blocks
            for m in (
                block.att.W_query,
                block.att.W_key,
                block.att.W_value,
                block.att.out_proj,
                *block.ff.layers[::2],
            )
        ]
        return (
            all(type(block.att) is FusedQKVSdpaAttention for block in model.trf_blocks)
            and all(type(m) is DecodeLinear for m in linears)  # LoRA's wrappers keep the module path
            and not model.training
            and is_decoding_step(idx)  # one token for each of the b rows
        )

    def hidden_states(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`model.hidden_states(ids, cache)` for one new token a row: ids (b, 1) -> (b, 1, emb)."""
        if not self.blocks:
            self._gather()
        model = self.model
        heads = model.cfg.n_heads
        b, t = ids.shape
        x = model.tok_emb(ids) + model.pos_emb(cache.start(t, ids.device))  # (b, 1, emb); no dropout in eval
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            shortcut = x
            queries, keys, values = block.qkv(block.norm1(x)).split(x.shape[-1], dim=-1)
            # (b, 1, emb) -> (b, heads, 1, head_dim)
            queries, keys, values = (y.view(b, t, heads, -1).transpose(1, 2) for y in (queries, keys, values))
            keys, values = layer.append(keys, values)  # (b, heads, past + 1, head_dim)
            if layer.allowed is None:  # one query sees every cached key
                context = F.scaled_dot_product_attention(
                    queries, keys, values, dropout_p=0.0, is_causal=False
                )
            else:
                context = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=layer.allowed, dropout_p=0.0
                )
            context = context.transpose(1, 2).contiguous().view(b, t, -1)  # (b, 1, emb)
            x = block.out_proj(context) + shortcut
            shortcut = x
            x = block.ff_out(block.gelu(block.ff_in(block.norm2(x)))) + shortcut
        return model.final_norm(x)


def _projection(linear: DecodeLinear) -> _Projection:
    return _Projection(linear.decode_weight.of([linear.weight]), linear.bias)
