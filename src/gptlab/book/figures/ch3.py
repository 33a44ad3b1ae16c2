"""Chapter 3, coding attention mechanisms: "Your journey starts with one step", from dot products to heads."""

from __future__ import annotations

from typing import Any

from gptlab.book.figures.inputs import FigureInputs

__all__ = [
    "journey_scores",
    "journey_weights",
    "journey_context",
    "trainable_attention",
    "self_attention_output",
    "causal_weights",
    "causal_mask_rows",
    "attention_output",
]


def _rows(tensor: Any) -> Any:
    return tensor.detach().tolist()


def journey_scores(run: FigureInputs | None, query: int | None = None) -> list[Any]:
    """Dot products of the inputs with input `query` (section 3.3.1), or all of them (3.3.2)."""
    # book.demos (torch) on first use: keeps `gptlab --help` fast
    from gptlab.book.demos import journey_inputs

    inputs = journey_inputs()
    scores = inputs @ inputs.T
    return _rows(scores if query is None else scores[query])


def journey_weights(run: FigureInputs | None, normalise: str, query: int | None = None) -> list[Any]:
    """The scores turned into weights by `sum` (dividing by the total), `naive` or `torch` softmax."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import journey_inputs, softmax_naive

    inputs = journey_inputs()
    scores = inputs @ inputs.T if query is None else inputs @ inputs[query]
    if normalise == "sum":
        weights = scores / scores.sum(dim=-1, keepdim=True)
    elif normalise == "naive":  # one query's scores (a vector), as the section does
        weights = softmax_naive(scores)
    else:
        weights = torch.softmax(scores, dim=-1)
    return _rows(weights)


def journey_context(run: FigureInputs | None, query: int | None = None) -> list[Any]:
    """Context vectors: the softmax weights times the inputs (3.3.1 for one query, 3.3.2 for all)."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import journey_inputs

    inputs = journey_inputs()
    context = torch.softmax(inputs @ inputs.T, dim=-1) @ inputs
    return _rows(context if query is None else context[query])


def trainable_attention(run: FigureInputs | None, seed: int, query: int, step: str) -> Any:
    """Section 3.4.1 for query `query` under SelfAttention_v1's seeded matrices: `query` vector,
    `keys_shape`, `score` with itself, `scores`, `weights` or `context`."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import SelfAttentionV1, journey_inputs

    torch.manual_seed(seed)
    attention = SelfAttentionV1(3, 2)
    inputs = journey_inputs()
    keys, values = inputs @ attention.W_key, inputs @ attention.W_value
    q = inputs[query] @ attention.W_query
    scores = q @ keys.T
    weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
    results = {
        "query": q,
        "keys_shape": list(keys.shape),
        "score": scores[query],
        "scores": scores,
        "weights": weights,
        "context": weights @ values,
    }
    result = results[step]
    return result if isinstance(result, list) else _rows(result)


def self_attention_output(run: FigureInputs | None, version: int, seed: int) -> list[Any]:
    """SelfAttention_v1 (listing 3.1) or _v2 (listing 3.2) over the six inputs, built after `seed`."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import SelfAttentionV1, SelfAttentionV2, journey_inputs

    torch.manual_seed(seed)
    attention = SelfAttentionV1(3, 2) if version == 1 else SelfAttentionV2(3, 2)
    return _rows(attention(journey_inputs()))


def causal_weights(run: FigureInputs | None, seed: int) -> list[Any]:
    """Section 3.5.1: SelfAttention_v2's weights (seed 789) with the future masked by -inf."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import SelfAttentionV2, journey_inputs

    torch.manual_seed(seed)
    return _rows(SelfAttentionV2(3, 2).attention_weights(journey_inputs(), causal=True))


def causal_mask_rows(run: FigureInputs | None, num_tokens: int) -> list[list[int]]:
    """Which keys each token may attend to: 1 on and below the diagonal."""
    # book.demos (torch) on first use: keeps `gptlab --help` fast
    from gptlab.book.demos import causal_mask

    return (causal_mask(num_tokens) == 0).int().tolist()


def attention_output(
    run: FigureInputs | None, module: str, seed: int, d_out: int, heads: int, shape: bool, sequence: int = 0
) -> Any:
    """The batch of the six inputs twice through `causal` attention (listing 3.3), the `wrapper` of heads
    (3.4) or the pipeline's `multihead` attention (3.5, gpt.py), built after `seed`: the output's
    shape, or the output for one `sequence` of the batch."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import CausalAttention, MultiHeadAttentionWrapper, journey_inputs
    from gptlab.model.gpt import MultiHeadAttention

    batch = torch.stack((journey_inputs(), journey_inputs()))  # (2, 6, 3)
    torch.manual_seed(seed)
    if module == "causal":
        attention: torch.nn.Module = CausalAttention(3, d_out, batch.shape[1], 0.0)
    elif module == "wrapper":
        attention = MultiHeadAttentionWrapper(3, d_out, batch.shape[1], 0.0, heads)
    else:
        attention = MultiHeadAttention(3, d_out, 0.0, heads)  # the book's masked softmax
    out = attention(batch)
    return list(out.shape) if shape else _rows(out[sequence])
