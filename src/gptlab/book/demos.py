"""The book's teaching code that the pipeline does not run: chapters 2 to 4, in the chapters' order.

Chapter 2's regex tokenizers, chapter 3's attention classes before multi-head
attention, and chapter 4's placeholder GPT and five-layer shortcut network.
They exist so that the reproduction report can compute the figures the book
prints for them; the pipeline's own model is model/gpt.py, which none of this
touches. Each class builds its layers in the book's order, so that after the
book's seed it holds the book's random weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GELU

# ---------------------------------------------------------------- chapter 2: text to ids

# Listing 2.3 splits on these; listing 2.4 (and the section before it) adds ":" and ";".
V1_PATTERN = r'([,.?_!"()\']|--|\s)'
V2_PATTERN = r'([,.:;?_!"()\']|--|\s)'
UNKNOWN, END_OF_TEXT = "<|unk|>", "<|endoftext|>"


def split_words(text: str, pattern: str = V2_PATTERN, *, strip: bool = True) -> list[str]:
    """re.split on `pattern`, keeping the separators; with `strip`, blank pieces dropped and the rest stripped."""
    pieces = re.split(pattern, text)
    return [piece.strip() for piece in pieces if piece.strip()] if strip else pieces


def build_vocab(words: list[str], specials: tuple[str, ...] = ()) -> dict[str, int]:
    """Listing 2.2: every distinct word in sorted order, then the special tokens, numbered from 0."""
    return {word: index for index, word in enumerate([*sorted(set(words)), *specials])}


class SimpleTokenizerV1:
    """Listing 2.3: words to ids and back; a word outside the vocabulary is a KeyError."""

    pattern = V1_PATTERN

    def __init__(self, vocab: dict[str, int]) -> None:
        self.str_to_int = vocab
        self.int_to_str = {i: s for s, i in vocab.items()}

    def encode(self, text: str) -> list[int]:
        return [self.str_to_int[word] for word in self._words(text)]

    def _words(self, text: str) -> list[str]:
        return split_words(text, self.pattern)

    def decode(self, ids: list[int]) -> str:
        text = " ".join(self.int_to_str[i] for i in ids)
        return re.sub(r'\s+([,.?!"()\'])', r"\1", text)  # no space before punctuation


class SimpleTokenizerV2(SimpleTokenizerV1):
    """Listing 2.4: unknown words become <|unk|>; texts are joined with <|endoftext|>."""

    pattern = V2_PATTERN

    def _words(self, text: str) -> list[str]:
        return [word if word in self.str_to_int else UNKNOWN for word in split_words(text, self.pattern)]

    def decode(self, ids: list[int]) -> str:
        text = " ".join(self.int_to_str[i] for i in ids)
        return re.sub(r'\s+([,.:;?!"()\'])', r"\1", text)


# ---------------------------------------------------------------- chapter 3: attention

# Section 3.3.1's six three-dimensional embeddings of "Your journey starts with one step".
JOURNEY_INPUTS = (
    (0.43, 0.15, 0.89),  # Your
    (0.55, 0.87, 0.66),  # journey
    (0.57, 0.85, 0.64),  # starts
    (0.22, 0.58, 0.33),  # with
    (0.77, 0.25, 0.10),  # one
    (0.05, 0.80, 0.55),  # step
)


def journey_inputs() -> torch.Tensor:
    return torch.tensor(JOURNEY_INPUTS)


def softmax_naive(x: torch.Tensor) -> torch.Tensor:
    """Section 3.3.1's softmax without the max subtraction (torch.softmax's guard against overflow)."""
    return torch.exp(x) / torch.exp(x).sum(dim=0)


class SelfAttentionV1(nn.Module):
    """Listing 3.1: scaled dot-product attention with raw weight matrices drawn by torch.rand."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys, queries, values = x @ self.W_key, x @ self.W_query, x @ self.W_value
        attn_weights = torch.softmax(queries @ keys.T / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class SelfAttentionV2(nn.Module):
    """Listing 3.2: the same with nn.Linear layers (their own initialisation, weights stored transposed)."""

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def attention_weights(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """The (t, t) weights; `causal` masks the future with -inf before the softmax (section 3.5.1)."""
        scores = self.W_query(x) @ self.W_key(x).T
        if causal:
            scores = scores.masked_fill(causal_mask(x.shape[0]).bool(), -torch.inf)
        return torch.softmax(scores / self.W_key.out_features**0.5, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention_weights(x) @ self.W_value(x)


def causal_mask(num_tokens: int) -> torch.Tensor:
    """1 above the diagonal: the future positions a token may not attend to."""
    return torch.triu(torch.ones(num_tokens, num_tokens), diagonal=1)


class CausalAttention(nn.Module):
    """Listing 3.3: batched single-head attention with the causal mask and dropout on the weights."""

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", causal_mask(context_length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[1]
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        scores = (queries @ keys.transpose(1, 2)).masked_fill(
            self.mask.bool()[:num_tokens, :num_tokens], -torch.inf
        )
        attn_weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        return attn_weights @ values


class MultiHeadAttentionWrapper(nn.Module):
    """Listing 3.4: several CausalAttention heads side by side, outputs concatenated."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([head(x) for head in self.heads], dim=-1)


# ---------------------------------------------------------------- chapter 4: the architecture


class DummyGPTModel(nn.Module):
    """Listing 4.1: the model's outline, with blocks and norm that return their input."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*(nn.Identity() for _ in range(cfg.n_layers)))
        self.final_norm = nn.Identity()
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, in_idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(in_idx.shape[1], device=in_idx.device)
        x = self.drop_emb(self.tok_emb(in_idx) + self.pos_emb(positions))
        return self.out_head(self.final_norm(self.trf_blocks(x)))


class ExampleDeepNeuralNetwork(nn.Module):
    """Section 4.4's five Linear + GELU layers, with or without shortcut connections."""

    def __init__(self, layer_sizes: list[int], use_shortcut: bool) -> None:
        super().__init__()
        self.use_shortcut = use_shortcut
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(n_in, n_out), GELU())
            for n_in, n_out in zip(layer_sizes, layer_sizes[1:], strict=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            layer_output = layer(x)
            x = x + layer_output if self.use_shortcut and x.shape == layer_output.shape else layer_output
        return x
