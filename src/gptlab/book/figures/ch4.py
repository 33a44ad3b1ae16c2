"""Chapter 4, implementing a GPT model: shapes, layer norm, GELU, shortcuts, parameter counts, greedy text."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from gptlab.book.figures.inputs import FigureInputs, raw_dir, tokenizer, tokenizer_of
from gptlab.errors import InputError
from gptlab.model.config import MODEL_PRESETS, ModelConfig

__all__ = [
    "parameter_count",
    "parameter_megabytes",
    "parameter_share",
    "module_parameters",
    "weight_shapes",
    "qkv_bias_parameters",
    "head_dims",
    "logits_shape",
    "layer_norm_demo",
    "gelu_values",
    "gelu_minimum",
    "gelu_tanh_gap",
    "shortcut_gradients",
    "shortcut_lift",
    "greedy_continuation",
]

# Listing 4.1's batch: "Every effort moves you" and "Every day holds a".
SAMPLE_TEXTS = ("Every effort moves you", "Every day holds a")


def _model(preset: str, context_length: int, qkv_bias: bool, *, seed: int | None = None) -> Any:
    """Our GPTModel: on the meta device (shapes, no memory) without a seed, else built after `seed`."""
    cfg = ModelConfig.from_preset(preset, context_length=context_length, qkv_bias=qkv_bias)
    return shapes_model(cfg) if seed is None else seeded_model(cfg, seed)


@functools.cache
def shapes_model(cfg: Any) -> Any:
    """Our GPTModel on the meta device, built once per shape: a report's figures ask for five shapes 35
    times. Shared, so read it and never change it."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.build import build_gpt

    with torch.device("meta"):
        return build_gpt(cfg)


@functools.cache
def seeded_model(cfg: Any, seed: int) -> Any:
    """The book's order: seed, then build (so the weights are the book's); in eval mode, built once."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.build import build_gpt

    torch.manual_seed(seed)
    return build_gpt(cfg).eval()


def parameter_count(
    run: FigureInputs | None, preset: str, context_length: int, qkv_bias: bool, head: str
) -> int:
    """Parameters of our GPTModel; head: untied (own out_head), tied (out_head = tok_emb), none."""
    if head not in ("untied", "tied", "none"):
        raise InputError(f"head: expected untied, tied or none, got {head!r}")
    model = _model(preset, context_length, qkv_bias)
    total = sum(p.numel() for p in model.parameters())
    # Tied, out_head's weight is tok_emb's, counted once: as many as with no head at all.
    return total if head == "untied" else total - model.out_head.weight.numel()


def parameter_megabytes(
    run: FigureInputs | None,
    preset: str,
    context_length: int,
    qkv_bias: bool,
    head: str,
    bytes_per_parameter: int,
) -> float:
    """Size in MiB (the book's "MB": bytes / 1024²)."""
    return parameter_count(run, preset, context_length, qkv_bias, head) * bytes_per_parameter / 1024**2


def parameter_share(run: FigureInputs | None, preset: str, module: str) -> float:
    """Percent of the untied model's parameters in `module` (see module_parameters)."""
    total = parameter_count(run, preset, 1024, False, "untied")
    return 100 * module_parameters(run, preset, module) / total


def module_parameters(run: FigureInputs | None, preset: str, module: str) -> int:
    """Parameters of one part of our gpt2 model (context 1024, no qkv bias): `tok_emb`, `pos_emb`,
    `block`, `blocks`, `att` and `ff` (of one block), `atts` (every block's attention), `final_norm`,
    `out_head`, `embeddings` (tok_emb and out_head, the two embedding-shaped matrices)."""
    model = _model(preset, 1024, False)
    parts = {
        "block": model.trf_blocks[0],
        "att": model.trf_blocks[0].att,
        "ff": model.trf_blocks[0].ff,
        "blocks": model.trf_blocks,
        "atts": [block.att for block in model.trf_blocks],
        "embeddings": [model.tok_emb, model.out_head],
    }
    chosen = parts.get(module, getattr(model, module, None))
    modules = chosen if isinstance(chosen, list) else [chosen]
    return sum(p.numel() for m in modules for p in m.parameters())


def weight_shapes(run: FigureInputs | None, preset: str, weights: list[str]) -> list[list[int]]:
    """The shapes of some of our model's weights, e.g. tok_emb.weight (section 4.6)."""
    model = _model(preset, 1024, False)
    return [list(model.get_parameter(weight).shape) for weight in weights]


def qkv_bias_parameters(run: FigureInputs | None, preset: str) -> int:
    """What qkv_bias adds: the query, key and value biases of every block (OpenAI's checkpoints have them)."""
    with_bias, without = (parameter_count(run, preset, 1024, bias, "tied") for bias in (True, False))
    return with_bias - without


def head_dims(run: FigureInputs | None, presets: list[str]) -> list[int]:
    return [MODEL_PRESETS[p]["emb_dim"] // MODEL_PRESETS[p]["n_heads"] for p in presets]


def logits_shape(run: FigureInputs | None, model: str, seed: int) -> list[int]:
    """Listing 4.1's batch through the `dummy` model or our GPTModel (`gpt`), built after `seed`."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import DummyGPTModel

    batch = torch.tensor([tokenizer(run).encode(text) for text in SAMPLE_TEXTS])
    cfg = ModelConfig.from_preset("gpt2-small", context_length=1024)
    torch.manual_seed(seed)
    network = DummyGPTModel(cfg).eval() if model == "dummy" else seeded_model(cfg, seed)
    with torch.no_grad():
        return list(network(batch).shape)


def layer_norm_demo(run: FigureInputs | None, step: str) -> Any:
    """Section 4.2 (seed 123, a batch of two five-feature rows through Linear(5, 6) + ReLU): the layer's
    `out`, its `mean` and `var` (torch's default n - 1), the rows normalised that way (`normalised`),
    and through our LayerNorm (population variance): `layer_norm`, its first value `layer_norm_first`,
    and the variance of the rows of the batch itself through it (`layer_norm_var`, listing 4.2's check)."""
    # torch on first use: keeps `gptlab --help` fast
    import torch
    from torch import nn

    from gptlab.model.gpt import LayerNorm

    torch.manual_seed(123)
    batch = torch.randn(2, 5)
    out = nn.Sequential(nn.Linear(5, 6), nn.ReLU())(batch)
    mean, var = out.mean(dim=-1, keepdim=True), out.var(dim=-1, keepdim=True)
    normed = LayerNorm(6)(out)
    results = {
        "out": out,
        "mean": mean,
        "var": var,
        "normalised": (out - mean) / torch.sqrt(var),
        "layer_norm": normed,
        "layer_norm_first": normed[0, 0],
        "layer_norm_var": LayerNorm(5)(batch).var(dim=-1, keepdim=True, unbiased=False),
    }
    return results[step].detach().tolist()


def gelu_values(run: FigureInputs | None, x: list[float]) -> list[float]:
    """Our GELU (GPT-2's tanh approximation) at these points."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.gpt import GELU

    return GELU()(torch.tensor(x)).tolist()


def _gelu_grid(low: float, high: float, step: float) -> Any:
    # torch on first use: keeps `gptlab --help` fast
    import torch

    return torch.arange(round((high - low) / step) + 1, dtype=torch.float64) * step + low


def gelu_minimum(run: FigureInputs | None, low: float, high: float, step: float) -> list[float]:
    """[x, GELU(x)] at our GELU's minimum over a grid (the dip below zero the section describes)."""
    # torch on first use: keeps `gptlab --help` fast
    from gptlab.model.gpt import GELU

    x = _gelu_grid(low, high, step)
    y = GELU()(x)
    i = int(y.argmin())
    return [float(x[i]), float(y[i])]


def gelu_tanh_gap(run: FigureInputs | None, low: float, high: float, step: float) -> list[float]:
    """[x, gap] where our tanh GELU is furthest from the exact x·Φ(x), over a grid."""
    # torch on first use: keeps `gptlab --help` fast
    import torch.nn.functional as F

    from gptlab.model.gpt import GELU

    x = _gelu_grid(low, high, step)
    gap = (GELU()(x) - F.gelu(x)).abs()
    i = int(gap.argmax())
    return [float(x[i]), float(gap[i])]


def shortcut_gradients(run: FigureInputs | None, use_shortcut: bool) -> list[float]:
    """Section 4.4: mean |gradient| of each layer's weight in the five-layer network (seed 123,
    input [1, 0, -1], MSE against 0), with or without shortcut connections."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.book.demos import ExampleDeepNeuralNetwork

    torch.manual_seed(123)
    network = ExampleDeepNeuralNetwork([3, 3, 3, 3, 3, 1], use_shortcut)
    output = network(torch.tensor([[1.0, 0.0, -1.0]]))
    torch.nn.MSELoss()(output, torch.tensor([[0.0]])).backward()
    return [layer[0].weight.grad.abs().mean().item() for layer in network.layers]


def shortcut_lift(run: FigureInputs | None) -> list[int]:
    """How many times larger each layer's gradient is with shortcuts, rounded."""
    with_, without = shortcut_gradients(run, True), shortcut_gradients(run, False)
    return [round(a / b) for a, b in zip(with_, without, strict=True)]


def greedy_continuation(
    run: FigureInputs | None,
    prompt: str,
    max_new_tokens: int,
    seed: int,
    preset: str,
    context_length: int,
    qkv_bias: bool,
    decoded: bool = False,
) -> list[int] | str:
    """The prompt's ids plus the greedy continuation of a freshly seeded, untrained model (chapter 4),
    or with `decoded` their text."""
    ids = list(_greedy(raw_dir(run), prompt, max_new_tokens, seed, preset, context_length, qkv_bias))
    return tokenizer(run).decode(ids) if decoded else ids


@functools.cache
def _greedy(
    folder: Path,
    prompt: str,
    max_new_tokens: int,
    seed: int,
    preset: str,
    context_length: int,
    qkv_bias: bool,
) -> tuple[int, ...]:
    # torch on first use: keeps `gptlab --help` fast
    import torch

    from gptlab.model.generate import generate

    ids = tokenizer_of(folder).encode(prompt)
    model = _model(preset, context_length, qkv_bias, seed=seed)
    return tuple(generate(model, torch.tensor([ids]), max_new_tokens)[0].tolist())  # (1, t + n)
