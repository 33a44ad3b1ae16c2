"""GPT-2, as built in chapter 4 of the book.

Modules are created in the book's order, so that after `torch.manual_seed(123)`
a freshly built model holds exactly the book's random weights. The only
additions are a KV cache for fast generation, a choice of attention kernel
(`scaled_dot_product_attention` or the book's masked softmax; same maths) and
of the other kernels (`kernels: fused`: torch's layer norm and tanh-GELU, one
matmul for the queries, keys and values, decoding steps against weights laid
out (in, out), and dropout masks drawn 16 bits an element; same maths and
parameter names). No I/O here: checkpoints live in
checkpoint.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.model.config import ModelConfig
from gptlab.model.dropout import Dropout, dropout_class, uses_keep_mask

# Rows up to which a CPU matmul is a decoding step: one token per sequence, a batch of one or two.
DECODE_ROWS = 2


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
    """Whether x (..., in) is a few rows at fp32 inference on the CPU: where DecodeWeight pays."""
    return (
        x.device.type == "cpu"
        and x.shape[:-1].numel() <= DECODE_ROWS
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


def decode_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b with W.T already laid out (in, out)."""
    rows = x.reshape(-1, x.shape[-1])
    out = rows @ weight_t if bias is None else torch.addmm(bias, rows, weight_t)
    return out.view(*x.shape[:-1], -1)


class Linear(nn.Linear):
    """nn.Linear (same initialisation, same parameters) whose decoding steps use a DecodeWeight (kernels: fused)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.decode_weight = DecodeWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_decoding_step(x):
            return decode_linear(x, self.decode_weight.of([self.weight]), self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_class(kernels: str) -> type[nn.Linear]:
    """The Linear layers of `kernels`: nn.Linear itself for the book's, Linear for fused."""
    return Linear if kernels == "fused" else nn.Linear


class LayerNorm(nn.Module):
    """Normalises each token's embedding to zero mean and unit (population) variance."""

    def __init__(self, emb_dim: int, eps: float = 1e-5, kernels: str = "book") -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "fused":  # one kernel instead of the book's six element-wise passes
            return F.layer_norm(x, self.scale.shape, self.scale, self.shift, self.eps)
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # GPT-2 (and TF) use the biased estimate
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    """GELU with GPT-2's tanh approximation."""

    def __init__(self, kernels: str = "book") -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "fused":
            return F.gelu(x, approximate="tanh")
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        linear = linear_class(cfg.kernels)
        self.layers = nn.Sequential(
            linear(cfg.emb_dim, 4 * cfg.emb_dim),
            GELU(cfg.kernels),
            linear(4 * cfg.emb_dim, cfg.emb_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class LayerKVCache:
    """Keys and values one attention layer has seen, so decoding reuses them.

    The buffers (b, heads, max_length, head_dim) are allocated once, with the
    first keys' dtype and device; each step writes its new positions in place
    and attention reads the filled prefix as a view: no copy per token.
    """

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.allowed: torch.Tensor | None = None  # this step's attention mask, set by KVCache.start

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (b, heads, t, head_dim) new keys and values; return all of them so far (views)."""
        if self.keys is None or self.values is None:
            b, heads, _, head_dim = keys.shape
            self.keys = keys.new_empty(b, heads, self.max_length, head_dim)
            self.values = values.new_empty(b, heads, self.max_length, head_dim)
        end = self.length + keys.shape[2]
        assert end <= self.max_length, f"{end} positions exceed the cache's {self.max_length}"
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]  # (b, heads, past + t, head_dim)


class KVCache:
    """One LayerKVCache per transformer block, and the left padding of each row, if any.

    `pad` (b,) counts the padding tokens at the start of each row of a batch of
    prompts of different lengths: each row's first real token gets position 0
    (GPT-2's positions are absolute) and no query attends to a padding key.
    """

    def __init__(self, n_layers: int, max_length: int, pad: torch.Tensor | None = None) -> None:
        self.layers = [LayerKVCache(max_length) for _ in range(n_layers)]
        self.pad = pad

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reset(self) -> None:
        """Forget every position, keeping the buffers."""
        for layer in self.layers:
            layer.length = 0

    def start(self, num_new: int, device: torch.device) -> torch.Tensor:
        """Positions (t,) or, with padding, (b, t) of `num_new` tokens; sets the layers' attention mask.

        The mask is None where plain causal attention is right: a prefill, or a
        single new query, which may see every cached key.
        """
        past = self.length
        positions = torch.arange(past, past + num_new, device=device)
        allowed = None
        if self.pad is not None:
            pad = self.pad.to(device).unsqueeze(1)  # (b, 1)
            key_pos = torch.arange(past + num_new, device=device)
            # A padding query sees only itself (a finite softmax); real queries never see padding.
            allowed = (key_pos >= pad).unsqueeze(1) | (key_pos == positions.unsqueeze(1))  # (b, t, past + t)
            if num_new > 1:
                allowed &= ~_future_mask(num_new, past + num_new, past, device)
            allowed = allowed.unsqueeze(1)  # (b, 1, t, past + t): the same for every head
            positions = (positions - pad).clamp(min=0)  # (b, t)
        elif past > 0 and num_new > 1:
            allowed = ~_future_mask(num_new, past + num_new, past, device)
        for layer in self.layers:
            layer.allowed = allowed
        return positions


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        d_in: int,
        d_out: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        attention: str = "sdpa",
        kernels: str = "book",
    ) -> None:
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.attention = attention
        self.kernels = kernels
        linear = linear_class(kernels)
        self.W_query = linear(d_in, d_out, bias=qkv_bias)
        self.W_key = linear(d_in, d_out, bias=qkv_bias)
        self.W_value = linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = linear(d_out, d_out)
        self.dropout = dropout_class(kernels)(dropout)
        self.decode_qkv = DecodeWeight()

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        b, num_tokens, _ = x.shape
        # (b, t, d_out) -> (b, t, heads, head_dim) -> (b, heads, t, head_dim)
        queries, keys, values = self._project_qkv(x)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        allowed = None  # None: causal over the keys, queries last
        if cache is not None:
            keys, values = cache.append(keys, values)  # (b, heads, past + t, head_dim)
            allowed = cache.allowed

        if self.attention == "sdpa":
            context = self._sdpa(queries, keys, values, allowed)
        else:
            context = self._masked_softmax(queries, keys, values, allowed)

        # (b, heads, t, head_dim) -> (b, t, heads, head_dim) -> (b, t, d_out)
        context = context.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context)

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of x, each (b, t, d_out): one matmul when the kernels are fused.

        Fused only while the three projections are the model's own Linears (LoRA,
        for one, replaces them with its own modules).
        """
        projections = (self.W_query, self.W_key, self.W_value)
        if self.kernels != "fused" or any(type(p) is not Linear for p in projections):
            return tuple(p(x) for p in projections)
        bias = None if self.W_query.bias is None else torch.cat([p.bias for p in projections])
        if is_decoding_step(x):
            weight_t = self.decode_qkv.of([p.weight for p in projections])  # (d_in, 3 * d_out)
            return decode_linear(x, weight_t, bias).split(self.d_out, dim=-1)
        weight = torch.cat([p.weight for p in projections])  # (3 * d_out, d_in)
        return F.linear(x, weight, bias).split(self.d_out, dim=-1)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        dropout_p = self.dropout.p if self.training else 0.0
        if isinstance(self.dropout, Dropout) and uses_keep_mask(q, dropout_p, self.training):
            # On the CPU, SDPA with dropout computes these same steps (its math path), its mask by
            # torch's element-at-a-time bernoulli_; the masked softmax draws it with keep_mask.
            if allowed is None and self.kernels == "fused":
                return self._biased_softmax(q, k, v)
            return self._masked_softmax(q, k, v, allowed)
        if allowed is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        # One query (a decoding step) sees every key: no mask at all.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=q.shape[2] > 1)

    def _masked_softmax(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        attn_scores = q @ k.transpose(2, 3)  # (b, heads, t, past + t)
        if allowed is not None:
            attn_scores.masked_fill_(~allowed, -torch.inf)
        elif q.shape[2] > 1:
            attn_scores.masked_fill_(_future_mask(q.shape[2], k.shape[2], 0, q.device), -torch.inf)
        attn_weights = torch.softmax(attn_scores / k.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ v  # (b, heads, t, head_dim)

    def _biased_softmax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The causal masked softmax with the mask and the 1/√d scale inside the scores' matmul.

        One baddbmm adds a -inf bias above the diagonal and scales by alpha, instead of
        the scores' two extra passes (masked_fill_, division) and the division's backward. One
        GPT-2 small attention layer's forward and backward took 1.7 ms less at bf16 (5 %) and
        0.7 ms at fp32 on the CPU measured (benchmarks/README.md).
        """
        b, heads, t, head_dim = q.shape
        bias = torch.zeros(t, t, device=q.device).masked_fill_(_future_mask(t, t, 0, q.device), -torch.inf)
        attn_scores = torch.baddbmm(
            bias,
            q.reshape(b * heads, t, head_dim),
            k.reshape(b * heads, t, head_dim).transpose(1, 2),
            alpha=1 / head_dim**0.5,
        )
        attn_weights = self.dropout(torch.softmax(attn_scores.view(b, heads, t, t), dim=-1))
        return attn_weights @ v  # (b, heads, t, head_dim)


def _future_mask(num_queries: int, num_keys: int, past: int, device: torch.device) -> torch.Tensor:
    """True where query i (at position past + i) would look at a later key."""
    query_pos = torch.arange(past, past + num_queries, device=device).unsqueeze(1)
    key_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return key_pos > query_pos  # (t, past + t)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            num_heads=cfg.n_heads,
            dropout=cfg.drop_rate,
            qkv_bias=cfg.qkv_bias,
            attention=cfg.attention,
            kernels=cfg.kernels,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim, kernels=cfg.kernels)
        self.norm2 = LayerNorm(cfg.emb_dim, kernels=cfg.kernels)
        self.drop_shortcut = dropout_class(cfg.kernels)(cfg.drop_rate)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        # Pre-norm: normalise, transform, drop, then add the shortcut.
        shortcut = x
        x = self.drop_shortcut(self.att(self.norm1(x), cache))
        x = x + shortcut

        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x)))
        return x + shortcut


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = dropout_class(cfg.kernels)(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = LayerNorm(cfg.emb_dim, kernels=cfg.kernels)
        linear = linear_class(cfg.kernels)
        if cfg.num_classes is None:
            self.out_head = linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        else:
            self.out_head = linear(cfg.emb_dim, cfg.num_classes)

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
        tok_embeds = self.tok_emb(in_idx)  # (b, t, emb)
        pos_embeds = self.pos_emb(positions)  # (t, emb) or (b, t, emb)
        x = self.drop_emb(tok_embeds + pos_embeds)
        for i, block in enumerate(self.trf_blocks):
            x = block(x, None if cache is None else cache.layers[i])
        return self.final_norm(x)
