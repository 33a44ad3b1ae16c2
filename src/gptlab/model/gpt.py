"""GPT-2, as built in chapter 4 of the book.

Layer normalisation, GELU, the feed-forward network, causal multi-head attention
(chapter 3's, with the book's masked softmax), the transformer block and the
model itself, each as the book writes it. Modules are created in the book's
order, so that after `torch.manual_seed(123)` a freshly built model holds
exactly the book's random weights. The forward passes take an optional KV cache
(kv_cache.py), as the book's bonus material adds one for generation.

The speed paths (torch's fused kernels, scaled dot-product attention, decoding
against weights laid out for it) live in fast_kernels.py, and build.py's
`build_gpt` builds the model a ModelConfig describes. No I/O here: checkpoints
live in checkpoint.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from gptlab.model.config import ModelConfig

if TYPE_CHECKING:
    from gptlab.model.kv_cache import KVCache, LayerKVCache


class LayerNorm(nn.Module):
    """Normalises each token's embedding to zero mean and unit (population) variance."""

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # GPT-2 (and TF) use the biased estimate
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    """GELU with GPT-2's tanh approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    """Each token through a layer four times as wide, GELU, and back: (b, t, emb) -> (b, t, emb)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),  # (b, t, emb) -> (b, t, 4 * emb)
            GELU(),
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),  # (b, t, 4 * emb) -> (b, t, emb)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MultiHeadAttention(nn.Module):
    """Causal self-attention in `num_heads` heads of d_out / num_heads dimensions each (chapter 3).

    The causal mask is made for the tokens at hand rather than kept as a
    (context, context) buffer: the state dict holds parameters only, as GPT-2's.
    """

    def __init__(self, d_in: int, d_out: int, dropout: float, num_heads: int, qkv_bias: bool = False) -> None:
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        b, num_tokens, _ = x.shape
        queries, keys, values = self.project_qkv(x)  # each (b, t, d_out)
        # (b, t, d_out) -> (b, t, heads, head_dim) -> (b, heads, t, head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        allowed = None  # None: causal over the keys, queries last
        if cache is not None:
            keys, values = cache.append(keys, values)  # (b, heads, past + t, head_dim)
            allowed = cache.allowed

        context = self.attend(queries, keys, values, allowed)  # (b, heads, t, head_dim)
        # (b, heads, t, head_dim) -> (b, t, heads, head_dim) -> (b, t, d_out)
        context = context.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The queries, keys and values of x (b, t, d_in), each (b, t, d_out)."""
        return self.W_query(x), self.W_key(x), self.W_value(x)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """The book's masked softmax: each query's weights over the keys it may see, applied to their values.

        q (b, heads, t, head_dim) against k and v (b, heads, past + t, head_dim); `allowed`
        (broadcast to (b, heads, t, past + t)) marks the keys each query sees, None for causal.
        """
        attn_scores = q @ k.transpose(2, 3)  # (b, heads, t, past + t)
        if allowed is not None:
            attn_scores.masked_fill_(~allowed, -torch.inf)
        elif q.shape[2] > 1:
            # The causal mask: True above the diagonal, where a query would see a later key.
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(diagonal=1)
            attn_scores.masked_fill_(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / k.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ v  # (b, heads, t, head_dim)


class TransformerBlock(nn.Module):
    """Attention, then the feed-forward network, each pre-normalised and around a shortcut (b, t, emb)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            num_heads=cfg.n_heads,
            dropout=cfg.drop_rate,
            qkv_bias=cfg.qkv_bias,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim)
        self.norm2 = LayerNorm(cfg.emb_dim)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        # Pre-norm: normalise, transform, drop, then add the shortcut.
        shortcut = x
        x = self.drop_shortcut(self.att(self.norm1(x), cache))
        x = x + shortcut

        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x)))
        return x + shortcut


class GPTModel(nn.Module):
    """GPT-2: token and position embeddings, `n_layers` transformer blocks, a final norm and an output head.

    Built from `cfg`'s sizes with the book's kernels; `cfg.kernels` and
    `cfg.attention` are build.build_gpt's to apply.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = LayerNorm(cfg.emb_dim)
        if cfg.is_language_model:
            self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        else:  # chapter 6's classification head
            self.out_head = nn.Linear(cfg.emb_dim, cfg.num_classes)

    def forward(self, in_idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (b, t, vocab or classes) for ids (b, t); with a cache, t new tokens after the cached ones."""
        return self.out_head(self.hidden_states(in_idx, cache))

    def hidden_states(self, in_idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """What the output head reads (b, t, emb): the normalised output of the last block."""
        _, seq_len = in_idx.shape
        past = 0 if cache is None else cache.length
        assert past + seq_len <= self.cfg.context_length, (
            f"{past + seq_len} positions exceed the context length {self.cfg.context_length}"
        )
        if cache is None:
            positions = torch.arange(seq_len, device=in_idx.device)
        else:
            positions = cache.start(seq_len, in_idx.device)  # (t,), or (b, t) for left-padded rows
        tok_embeds = self.tok_emb(in_idx)  # (b, t) -> (b, t, emb)
        pos_embeds = self.pos_emb(positions)  # (t, emb) or (b, t, emb)
        x = self.drop_emb(tok_embeds + pos_embeds)  # (b, t, emb)
        for i, block in enumerate(self.trf_blocks):
            x = block(x, None if cache is None else cache.layers[i])
        return self.final_norm(x)
