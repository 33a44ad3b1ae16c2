"""Corpus pretraining's speed: the step on memory-mapped token shards beside the Verdict path's, and the book's.

Variants, each at one pretrain config (params.yaml's, or `--profile`'s), on the same token ids:

- **ours, corpus**: the shared loop's own step (`TrainingSetup.train_step`, with its gradient
  accumulation) on the micro-batches its `DataOrder` reads from `ShardWindows`: token shards
  through memory maps, as pretrain reads a corpus;
- **ours, Verdict path**: the same step on the same ids held in memory (`GPTDatasetV1`), as
  pretrain reads The Verdict;
- with `--book`, **book (speed bonus)**: the bonus's optimized single-GPU step
  (benchmarks/book_speed_bonus.py) at the same model, context and micro-batch (one batch a
  step, as the bonus: no accumulation).

Each variant takes `--warmup` untimed steps (torch.compile's, the allocator's), then the
variants alternate for `--rounds` rounds of `--steps` timed steps; the table gives each one's
median: s/step, tokens/s, the ratio to the book (or to the Verdict path), MFU where the peak is
known (`--peak-tflops`, or the GPU's from gptlab.training.throughput), and the loader's share:
the time spent drawing the step's batches from the dataset over the step's whole time.

    python benchmarks/bench_corpus_pretrain.py                  # GPT-2 small, params.yaml's pretrain, CPU
    python benchmarks/bench_corpus_pretrain.py --profile profiles/gutenberg.yaml --device cuda --book
    python benchmarks/bench_corpus_pretrain.py --tiny --book    # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from book_speed_bonus import bonus_step

from gptlab.data.corpus_windows import ShardWindows
from gptlab.data.token_shards import ShardWriter
from gptlab.data.verdict import GPTDatasetV1
from gptlab.experiments.profiles import profile_params
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import Progress
from gptlab.model.config import ModelConfig
from gptlab.pipeline.params import PARAMS_FILE, load_params
from gptlab.training.chunked_loss import language_model_loss
from gptlab.training.config import TrainConfig
from gptlab.training.data_order import DataOrder
from gptlab.training.loop import Untracked, micro_batches, setup_training
from gptlab.training.runtime import resolve_precision
from gptlab.training.throughput import flops_per_token, peak_flops

# Runs `steps` timed steps; returns (seconds, seconds spent drawing batches).
Timed = Callable[[int], tuple[float, float]]
CORPUS = "ours, corpus (memory-mapped shards)"
VERDICT = "ours, Verdict path (ids in memory)"
BOOK = "book (speed bonus, bf16 weights)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours(
    dataset: Any, model_cfg: ModelConfig, vocab_multiple: int | None, train: TrainConfig, device: torch.device
) -> Timed:
    """The loop's step on `dataset`, its batches drawn as `fit` draws them (epochs repeat as needed),
    with the head padded as the pretrain stage pads it (`vocab_multiple`)."""
    torch.manual_seed(train.seed)
    run = setup_training(
        build_gpt(model_cfg, vocab_multiple),
        dataset,
        train,
        language_model_loss(train.loss_kernel),
        Untracked(),
        example_seen=model_cfg.context_length,
    )
    order, progress = DataOrder(dataset, dataset, train, run.world, None), Progress()
    order.start_afresh()

    def steps_forever() -> Iterator[list[Any]]:
        while True:
            yield from micro_batches(order.epoch_batches(progress), run.accumulation)
            progress.epoch += 1

    groups = steps_forever()

    def timed(steps: int) -> tuple[float, float]:
        synchronize(device)
        loading, started = 0.0, time.perf_counter()
        for step in range(steps):
            drawn = time.perf_counter()
            batches = next(groups)
            loading += time.perf_counter() - drawn
            run.train_step(batches, train.lr, step, None)  # type: ignore[arg-type]  # no checkpoint to name
        synchronize(device)
        return time.perf_counter() - started, loading

    return timed


def book(ids: np.ndarray, model_cfg: ModelConfig, batch_size: int, device: torch.device) -> Timed:
    """The speed bonus's step, on shuffled windows of the same ids (compiled on CUDA only)."""
    step, _ = bonus_step(model_cfg, device, compile_model=device.type == "cuda")
    windows = GPTDatasetV1(ids, model_cfg.context_length, model_cfg.context_length)
    generator = torch.Generator().manual_seed(123)

    def timed(steps: int) -> tuple[float, float]:
        synchronize(device)
        loading, started = 0.0, time.perf_counter()
        for _ in range(steps):
            drawn = time.perf_counter()
            picks = torch.randint(len(windows), (batch_size,), generator=generator).tolist()
            inputs, targets = (
                torch.stack(column) for column in zip(*(windows[i] for i in picks), strict=True)
            )
            loading += time.perf_counter() - drawn
            step(inputs.pin_memory() if device.type == "cuda" else inputs, targets)
        synchronize(device)
        return time.perf_counter() - started, loading

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", type=Path, help="a profile applied to params.yaml (default: none)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--book", action="store_true", help="adds the speed bonus's optimized step")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak (default: the GPU's, if known)")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer, 64-dim model, context 32: a smoke run"
    )
    args = parser.parse_args()

    params = profile_params(args.profile, PARAMS_FILE) if args.profile else load_params(PARAMS_FILE)
    device = torch.device(args.device)
    tiny = {"context_length": 32, "emb_dim": 64, "n_layers": 2, "n_heads": 2} if args.tiny else {}
    model_cfg = dataclasses.replace(params.pretrain.model.resolve(), **tiny)
    padding = params.pretrain.model.vocab_multiple
    train = dataclasses.replace(
        params.pretrain.train,
        device=args.device,
        compile=params.pretrain.train.compile and device.type == "cuda",
    )
    context = model_cfg.context_length
    accumulation = (train.global_batch_tokens or train.batch_size * context) // (train.batch_size * context)
    step_tokens = train.batch_size * context * accumulation
    # Enough distinct windows for every step of one round (epochs repeat after).
    windows = max(64, train.batch_size * accumulation * args.steps * 2)
    ids = np.random.default_rng(0).integers(0, 50_257, size=windows * context + 1)

    with tempfile.TemporaryDirectory(prefix="gptlab-bench-corpus-") as folder:
        writer = ShardWriter(Path(folder), "train", shard_tokens=max(len(ids) // 4, context + 1))
        writer.write(ids)
        # Each variant's step and the tokens it trains on.
        variants: dict[str, tuple[Timed, int]] = {
            CORPUS: (
                ours(ShardWindows(writer.close(), context, context), model_cfg, padding, train, device),
                step_tokens,
            ),
            VERDICT: (
                ours(GPTDatasetV1(ids, context, context), model_cfg, padding, train, device),
                step_tokens,
            ),
        }
        if args.book:
            variants[BOOK] = (book(ids, model_cfg, train.batch_size, device), train.batch_size * context)
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for timed, _ in variants.values():
            timed(args.warmup)
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        loader: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (timed, _) in variants.items():
                wall, loading = timed(args.steps)
                seconds[name].append(wall / args.steps)
                loader[name].append(loading / wall)
        load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())

    precision = resolve_precision(device, train.precision)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, precision)
    print(
        f"{model_cfg.n_layers} layers, {model_cfg.emb_dim} dims, context {context}; {accumulation} micro-batch(es) "
        f"of {train.batch_size} windows a step ({step_tokens:,} tokens) on {device}, {precision}, "
        f"compile {train.compile}; median of {args.rounds} rounds of {args.steps} steps after {args.warmup}; "
        f"load average {load_before} before, {load_after} after"
    )
    # Useful FLOPs: GPT-2's 50,257-word head for every variant (the book's padded columns do no work).
    per_token = flops_per_token(model_cfg, sum(p.numel() for p in build_gpt(model_cfg).parameters()))
    rate = {name: tokens / statistics.median(seconds[name]) for name, (_, tokens) in variants.items()}
    baseline = BOOK if args.book else VERDICT
    print(f"ratio: tokens/s over {baseline}'s; loader: the share of a step spent drawing its batches")
    print(f"{'variant':<38}{'s/step':>10}{'tokens/s':>12}{'ratio':>10}{'MFU':>8}{'loader':>9}")
    for name in variants:
        share = f"{rate[name] * per_token / peak:.1%}" if peak else "-"
        print(
            f"{name:<38}{statistics.median(seconds[name]):>10.4f}{rate[name]:>12,.0f}"
            f"{rate[name] / rate[baseline]:>9.2f}x{share:>8}{statistics.median(loader[name]):>9.2%}"
        )


if __name__ == "__main__":
    main()
