"""The KV cache of generation: each attention layer's keys and values, so a new token costs one forward.

As the book's bonus material adds one to chapter 4's model: the blocks append
their new keys and values here and attend over all of them. Left-padded batches
(prompts of different lengths generated at once) get their positions and
attention mask here too. `generate` (generate.py) creates and drives it.
"""

from __future__ import annotations

import torch


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
                allowed &= ~future_mask(num_new, past + num_new, past, device)
            allowed = allowed.unsqueeze(1)  # (b, 1, t, past + t): the same for every head
            positions = (positions - pad).clamp(min=0)  # (b, t)
        elif past > 0 and num_new > 1:
            allowed = ~future_mask(num_new, past + num_new, past, device)
        for layer in self.layers:
            layer.allowed = allowed
        return positions


def future_mask(num_queries: int, num_keys: int, past: int, device: torch.device) -> torch.Tensor:
    """Chapter 3's causal mask past a cache: True where query i (at position past + i) would look at a later key."""
    query_pos = torch.arange(past, past + num_queries, device=device).unsqueeze(1)  # (t, 1)
    key_pos = torch.arange(num_keys, device=device).unsqueeze(0)  # (1, past + t)
    return key_pos > query_pos  # (t, past + t)
