"""One GPT-2 training step four ways (six where bf16 is fast), rounds interleaved, against the GEMM rate.

The variants, each GPT-2 small dimensions (untied head), cross entropy and
AdamW on the same random token ids:

1. book: the book's chapter 4 model written out below (LayerNorm and GELU by
   hand, masked softmax over separate Q/K/V projections), default AdamW, fp32;
2. ours, default: GPTModel with params.yaml's pretrain settings (book-exact);
3. ours, fast: GPTModel with profiles/fast.yaml applied (read at run time);
4. transformers: GPT2LMHeadModel, SDPA attention, fused AdamW, at the fast
   profile's resolved precision;
5. and 6., where that precision is bf16: the fast profile and transformers
   again with fp32 forced, so each precision has its own comparison;
7. with --compile: the fast profile through torch.compile.

"vs transformers" compares each row with transformers at the row's precision.

The process keeps freed memory as the stages do (gptlab.pipeline.memory), and that holds
for every variant, transformers included; `--glibc-malloc` measures them all
with glibc's defaults instead, as a script that does not set it runs.

Each round runs one step of every variant in turn (so load on a shared
machine hits them alike); the table shows each variant's median. Before the
rounds, one untimed step per variant warms up (and compiles, if the fast
profile says so: its time is printed). The share of the GEMM rate is the
step's matmul FLOPs per second over the rate of large square matmuls measured
in the same rounds (fp32; bf16 too where bf16 is fast here).

    python benchmarks/bench_train_step.py              # the real measurement (minutes on a CPU, ~12 GB)
    python benchmarks/bench_train_step.py --tiny       # a seconds-long smoke run
    python benchmarks/bench_train_step.py --device cuda
    python benchmarks/bench_train_step.py --compile    # adds the compiled step (first step: the compile)
    python benchmarks/bench_train_step.py --glibc-malloc   # every variant with glibc's malloc defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.experiments.profiles import profile_params
from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.pipeline.memory import keep_freed_memory
from gptlab.pipeline.params import PARAMS_FILE, load_params
from gptlab.training.chunked_loss import language_model_loss
from gptlab.training.compilation import CompiledOrEager
from gptlab.training.config import TrainConfig
from gptlab.training.loop import make_adamw
from gptlab.training.losses import next_token_loss
from gptlab.training.runtime import autocast, bf16_is_fast, use_precision

FAST_PROFILE = Path("profiles/fast.yaml")
Step = Callable[[], float]


# --------------------------------------------------------------------------- #
# The book's chapter 4 model, as printed (GPT_CONFIG_124M with qkv_bias False)
# --------------------------------------------------------------------------- #


class BookLayerNorm(nn.Module):
    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class BookGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * x**3)))


class BookAttention(nn.Module):
    def __init__(self, d: int, context: int, dropout: float, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.W_query, self.W_key, self.W_value = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context, context), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x))
        scores = q @ k.transpose(2, 3)
        scores.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
        weights = self.dropout(torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1))
        return self.out_proj((weights @ v).transpose(1, 2).contiguous().view(b, t, d))


class BookBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.emb_dim
        self.att = BookAttention(d, cfg.context_length, cfg.drop_rate, cfg.n_heads)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), BookGELU(), nn.Linear(4 * d, d))
        self.norm1, self.norm2 = BookLayerNorm(d), BookLayerNorm(d)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class BookGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*(BookBlock(cfg) for _ in range(cfg.n_layers)))
        self.final_norm = BookLayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, in_idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(in_idx.shape[1], device=in_idx.device)
        x = self.drop_emb(self.tok_emb(in_idx) + self.pos_emb(positions))
        return self.out_head(self.final_norm(self.trf_blocks(x)))


# --------------------------------------------------------------------------- #
# The variants' steps
# --------------------------------------------------------------------------- #


def step_of(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast_context: Callable[[], torch.autocast],
) -> Step:
    """One training step of `model` as a function returning the loss (which waits for the device)."""
    model.train()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast_context():
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        # Free the gradients now, not at the next step: seven variants' would hold ~3.5 GB meanwhile.
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def book_step(cfg: ModelConfig, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> Step:
    torch.manual_seed(123)
    model = BookGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    return step_of(model, optimizer, next_token_loss, batch, lambda: autocast(device, "fp32"))


def ours_step(
    cfg: ModelConfig, train: TrainConfig, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> Step:
    """The step `gptlab.training.loop.fit` takes with these settings: its model, optimizer, loss and precision."""
    torch.manual_seed(123)
    model = build_gpt(cfg).to(device)
    loss_fn = language_model_loss(train.loss_kernel)
    if train.compile:
        loss_fn = CompiledOrEager(loss_fn)
    optimizer = make_adamw(list(model.parameters()), train)
    return step_of(model, optimizer, loss_fn, batch, lambda: autocast(device, train.precision))


def transformers_step(
    cfg: ModelConfig, precision: str, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> Step:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context_length,
        n_embd=cfg.emb_dim,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        resid_pdrop=cfg.drop_rate,
        embd_pdrop=cfg.drop_rate,
        attn_pdrop=cfg.drop_rate,
        tie_word_embeddings=False,  # as ours and the book's: the same parameters for AdamW to update
        attn_implementation="sdpa",
    )
    torch.manual_seed(123)
    model = GPT2LMHeadModel(hf_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, fused=True)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = m(input_ids=b[0]).logits
        return F.cross_entropy(logits.flatten(0, 1), b[1].flatten())

    return step_of(model, optimizer, loss_fn, batch, lambda: autocast(device, precision))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- #
# FLOPs and the GEMM rate
# --------------------------------------------------------------------------- #

FLOPS_FORMULA = (
    "step FLOPs = 6 * N * tokens + 12 * layers * batch * context^2 * emb, where N = 12 * layers * emb^2 + "
    "vocab * emb are the weights in matmuls (forward 2 FLOPs per weight per token, backward 4) and the second "
    "term is attention's two matmuls (QK^T, AV: 2 * 2 * b * t^2 * emb per layer forward, x3 with backward)"
)


def step_flops(cfg: ModelConfig, batch_size: int) -> float:
    tokens = batch_size * cfg.context_length
    matmul_weights = 12 * cfg.n_layers * cfg.emb_dim**2 + cfg.vocab_size * cfg.emb_dim
    attention = 12 * cfg.n_layers * batch_size * cfg.context_length**2 * cfg.emb_dim
    return 6 * matmul_weights * tokens + attention


def gemm_timer(size: int, dtype: torch.dtype, device: torch.device) -> Callable[[], float]:
    """A function that times one size^3 matmul and returns its FLOP/s."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)

    def rate() -> float:
        start = time.perf_counter()
        (a @ b).sum().item()
        return 2 * size**3 / (time.perf_counter() - start)

    rate()  # warm-up
    return rate


# --------------------------------------------------------------------------- #


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed steps per variant (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer, 64-dim model, 512 ids, context 32: a smoke run"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="adds the fast profile through torch.compile (its first step is the compile: cold, or warm "
        "from .gptlab/compile-cache/)",
    )
    parser.add_argument("--peak-tflops", type=float, help="adds MFU against this peak (H200 bf16 dense: 989)")
    parser.add_argument(
        "--glibc-malloc",
        action="store_true",
        help="leave malloc at glibc's defaults (large blocks unmapped on free) instead of keeping "
        "freed memory as the stages do",
    )
    args = parser.parse_args()
    if args.glibc_malloc:
        memory = "freed memory returned (glibc defaults)"
    elif keep_freed_memory():
        memory = "freed memory kept, as the stages do"
    else:
        memory = "freed memory as this platform's malloc does"

    device = torch.device(args.device)
    default = load_params(PARAMS_FILE).pretrain
    fast = profile_params(FAST_PROFILE, PARAMS_FILE).pretrain
    shape = (
        {"vocab_size": 512, "context_length": 32, "emb_dim": 64, "n_layers": 2, "n_heads": 2}
        if args.tiny
        else {}
    )
    default_cfg = dataclasses.replace(default.model.resolve(), **shape)
    fast_cfg = dataclasses.replace(fast.model.resolve(), **shape)
    fast_precision = use_precision(device, fast.train.precision)
    gemm_size = 512 if args.tiny else 4096

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, default_cfg.vocab_size, (args.batch_size, default_cfg.context_length + 1), generator=generator
    )
    batch = (ids[:, :-1].to(device), ids[:, 1:].to(device))
    tokens = batch[0].numel()
    print(
        f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"emb {default_cfg.emb_dim} x {default_cfg.n_layers} layers, batch {args.batch_size} x "
        f"{default_cfg.context_length} tokens; median of {args.rounds} interleaved rounds; {memory}"
    )
    print(
        f"ours, fast: {FAST_PROFILE} -> attention {fast_cfg.attention}, kernels {fast_cfg.kernels}, "
        f"precision {fast.train.precision} -> {fast_precision}, fused AdamW {fast.train.fused_adamw}, "
        f"loss {fast.train.loss_kernel}, compile {fast.train.compile}"
    )
    variants: dict[str, tuple[Step, str]] = {}
    warmup: dict[str, float] = {}
    builders = {
        "book (ch. 4 model, AdamW)": (lambda: book_step(default_cfg, batch, device), "fp32"),
        "ours, default params": (lambda: ours_step(default_cfg, default.train, batch, device), "fp32"),
        "ours, fast profile": (lambda: ours_step(fast_cfg, fast.train, batch, device), fast_precision),
        "transformers GPT2LMHeadModel": (
            lambda: transformers_step(fast_cfg, fast_precision, batch, device),
            fast_precision,
        ),
    }
    if fast_precision != "fp32":  # each must win at both precisions: fp32 forced too
        fast_fp32 = dataclasses.replace(fast.train, precision="fp32")
        builders["ours, fast profile, fp32"] = (lambda: ours_step(fast_cfg, fast_fp32, batch, device), "fp32")
        builders["transformers, fp32"] = (lambda: transformers_step(fast_cfg, "fp32", batch, device), "fp32")
    if args.compile:
        compiled = dataclasses.replace(fast.train, compile=True)
        builders["ours, fast + torch.compile"] = (
            lambda: ours_step(fast_cfg, compiled, batch, device),
            fast_precision,
        )
    for name, (build, precision) in builders.items():
        step = build()
        start = time.perf_counter()
        step()
        warmup[name] = time.perf_counter() - start
        variants[name] = (step, precision)
    print("first (warm-up) step, s: " + ", ".join(f"{name} {s:.2f}" for name, s in warmup.items()))

    gemm = {"fp32": gemm_timer(gemm_size, torch.float32, device)}
    if bf16_is_fast(device):
        gemm["bf16"] = gemm_timer(gemm_size, torch.bfloat16, device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    rates: dict[str, list[float]] = {name: [] for name in gemm}
    for _ in range(args.rounds):
        for name, (step, _) in variants.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        for name, rate in gemm.items():
            rates[name].append(rate())

    flops = step_flops(default_cfg, args.batch_size)
    print(FLOPS_FORMULA)
    print(
        f"step: {flops / 1e9:.1f} GFLOP; GEMM rate ({gemm_size}^3, median): "
        + ", ".join(f"{name} {statistics.median(r) / 1e9:.1f} GFLOP/s" for name, r in rates.items())
    )
    median = {name: statistics.median(t) for name, t in times.items()}
    book = median["book (ch. 4 model, AdamW)"]
    transformers_at = {fast_precision: median["transformers GPT2LMHeadModel"]}
    transformers_at.setdefault("fp32", median.get("transformers, fp32", 0.0))
    print(
        f"{'variant':<30} {'s/step':>8} {'tokens/s':>9} {'vs book':>8} {'vs transformers':>16} {'GEMM share':>11}"
    )
    for name, seconds in median.items():
        precision = variants[name][1]
        hf = transformers_at[precision]  # transformers at the same precision
        rate = statistics.median(rates.get(precision, rates["fp32"]))
        share = flops / seconds / rate
        mfu = f" {flops / seconds / (args.peak_tflops * 1e12):>6.1%}" if args.peak_tflops else ""
        print(
            f"{name:<30} {seconds:>8.4g} {tokens / seconds:>9.1f} {book / seconds:>7.2f}x "
            f"{hf / seconds:>15.2f}x {share:>10.0%}{mfu}  ({precision})"
        )
    for precision, rate in rates.items():
        limit, hf = flops / statistics.median(rate), transformers_at[precision]
        print(
            f"{f'the {precision} GEMM limit':<30} {limit:>8.4g} {tokens / limit:>9.1f} {book / limit:>7.2f}x "
            f"{hf / limit:>15.2f}x {1:>10.0%}"
        )


if __name__ == "__main__":
    main()
