"""Training throughput of one GPT-2 step: the book's formulation against ours, measured in one run.

Each variant trains the same model (GPT-2 small dimensions, context 256,
batch 2 by default) on random token ids for a few steps after a warm-up step,
and reports the median seconds per step and tokens per second. Ratios are
against the first variant, the book's: masked-softmax attention, fp32, the
default (for-loop) AdamW. Ours adds scaled_dot_product_attention, the fused
AdamW kernel and bf16 autocast (only where the CPU has bf16 instructions).

    python benchmarks/bench_train_step.py             # the real measurement (minutes on a CPU)
    python benchmarks/bench_train_step.py --tiny      # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import torch

from gptlab.architecture import ModelConfig
from gptlab.losses import next_token_loss
from gptlab.model import GPTModel


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    attention: str
    fused_adamw: bool
    bf16: bool


def bf16_supported() -> bool:
    """bf16 autocast pays off on CPUs with AVX-512 BF16 or AMX, and on any CUDA device."""
    if torch.cuda.is_available():
        return True
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def variants(with_bf16: bool) -> list[Variant]:
    found = [
        Variant("book: masked softmax, fp32, AdamW", "masked_softmax", False, False),
        Variant("+ sdpa attention", "sdpa", False, False),
        Variant("+ fused AdamW", "sdpa", True, False),
    ]
    if with_bf16:
        found.append(Variant("+ bf16 autocast (ours)", "sdpa", True, True))
    return found


def time_steps(
    variant: Variant, cfg: ModelConfig, batch: int, steps: int, device: torch.device
) -> list[float]:
    """Seconds of each timed step (after one untimed warm-up step)."""
    torch.manual_seed(123)
    model = GPTModel(dataclasses.replace(cfg, attention=variant.attention)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, fused=variant.fused_adamw)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1), generator=generator)
    inputs, targets = ids[:, :-1].to(device), ids[:, 1:].to(device)  # (b, t) each
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=variant.bf16):
            loss = next_token_loss(model, (inputs, targets))
        loss.backward()
        optimizer.step()
        loss.item()  # waits for the device
        if i > 0:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--context", type=int, default=None, help="default: 256, or 32 with --tiny")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-dim model: a smoke run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="the bf16 variant: auto runs it only where the hardware supports bf16",
    )
    args = parser.parse_args()
    args.context = args.context or (32 if args.tiny else 256)

    device = torch.device(args.device)
    dims = {"emb_dim": 64, "n_layers": 2, "n_heads": 2} if args.tiny else {}
    cfg = ModelConfig.from_preset("gpt2-small", context_length=args.context, drop_rate=0.1, **dims)
    tokens = args.batch_size * args.context
    print(
        f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"emb {cfg.emb_dim} x {cfg.n_layers} layers, batch {args.batch_size} x {args.context} tokens; "
        f"median of {args.steps} steps"
    )
    results: list[tuple[str, float]] = []
    with_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and bf16_supported())
    if not with_bf16:
        print("no bf16 variant: this CPU has neither AVX-512 BF16 nor AMX (force it with --bf16 on)")
    for variant in variants(with_bf16):
        seconds = statistics.median(time_steps(variant, cfg, args.batch_size, args.steps, device))
        results.append((variant.name, seconds))
        gc.collect()  # free the previous model and optimizer before the next one
    base = results[0][1]
    print(f"{'variant':<36} {'s/step':>8} {'tokens/s':>9} {'speed-up':>9}")
    for name, seconds in results:
        print(f"{name:<36} {seconds:>8.3f} {tokens / seconds:>9.1f} {base / seconds:>8.2f}x")


if __name__ == "__main__":
    main()
