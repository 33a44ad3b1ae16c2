"""Greedy generation speed: our KV cache against transformers' `generate` and the book's uncached loop.

One GPT-2 small model (context 1024, random weights, the head tied to the
token embedding as GPT-2's) continues a short prompt by 100 and by 900 new
tokens, greedily, in three ways:

- ours: `gptlab.model.generate.generate` with the KV cache (sdpa attention, the fast
  profile's fused kernels: one Q/K/V matmul, decoding steps against (in, out)
  weight copies), and the same with the book's kernels;
- ours with bf16 weights (an inference precision, where bf16 is fast or with
  --bf16-weights on): the same weights cast to bf16, its tokens compared with
  transformers' fp32 ones, and its quality line: on QUALITY_PROMPTS fixed
  random prompts, in how many the first QUALITY_TOKENS greedy tokens equal the
  fp32 model's, and the largest logit difference at the prompts' last
  positions relative to the fp32 logits' spread;
- transformers: `GPT2LMHeadModel.generate(do_sample=False, use_cache=True)` on
  the same weights (converted by gptlab.model.hf_gpt2), never stopping at end-of-text;
- the book: chapter 5's `generate_text_simple`, which reruns the whole sequence
  for every token (at 100 new tokens only: it is slow).

Rounds are interleaved (every variant once per round), so a busy machine
slows all of them alike; the table gives the median tokens/s of each and its
ratio to transformers, and says whether our tokens equal transformers'.

    python benchmarks/bench_generate.py               # the real measurement (~2 minutes on 2 cores)
    python benchmarks/bench_generate.py --tiny        # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gptlab.model.build import build_gpt
from gptlab.model.config import ModelConfig
from gptlab.model.generate import generate
from gptlab.model.gpt import GPTModel
from gptlab.model.hf_gpt2 import gptlab_to_hf, hf_config
from gptlab.training.runtime import bf16_is_fast

PROMPT = [6109, 3626, 6100, 345]  # "Every effort moves you"
QUALITY_PROMPTS, QUALITY_TOKENS = 16, 20


def book_generate(model: GPTModel, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The book's `generate_text_simple`: the whole (cropped) sequence through the model per token."""
    context_size = model.cfg.context_length
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -context_size:]
        with torch.no_grad():
            logits = model(idx_cond)
        logits = logits[:, -1, :]
        idx_next = torch.argmax(logits, dim=-1, keepdim=True)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def build_models(cfg: ModelConfig) -> tuple[GPTModel, GPT2LMHeadModel]:
    """Ours (fused kernels) and transformers' GPT-2 holding the same random weights (a tied head, as GPT-2's)."""
    torch.manual_seed(123)
    ours = build_gpt(dataclasses.replace(cfg, kernels="fused")).eval()
    with torch.no_grad():
        ours.out_head.weight.copy_(ours.tok_emb.weight)
    theirs = GPT2LMHeadModel(GPT2Config(**hf_config(cfg)))
    theirs.load_state_dict(gptlab_to_hf(ours, tie_head=True), strict=False)  # the tied lm_head is implied
    theirs.generation_config.eos_token_id = None  # random weights: never stop early
    theirs.generation_config.pad_token_id = None
    return ours, theirs.eval()


def variants(
    ours: GPTModel, theirs: GPT2LMHeadModel, bf16_weights: GPTModel | None
) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    book_kernels = build_gpt(dataclasses.replace(ours.cfg, kernels="book")).eval()
    book_kernels.load_state_dict(ours.state_dict())
    runs: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "ours (KV cache)": lambda idx, n: generate(ours, idx, n),
        "ours, book kernels": lambda idx, n: generate(book_kernels, idx, n),
    }
    if bf16_weights is not None:
        runs["ours, bf16 weights"] = lambda idx, n: generate(bf16_weights, idx, n)
    runs["transformers generate"] = lambda idx, n: theirs.generate(
        idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, do_sample=False, use_cache=True
    )
    runs["book (no cache)"] = lambda idx, n: book_generate(ours, idx, n)
    return runs


def bf16_quality(ours: GPTModel, bf16_weights: GPTModel) -> str:
    """The bf16 weights against fp32 on fixed random prompts: equal greedy tokens, the logits' difference."""
    prompts = torch.randint(
        0, ours.cfg.vocab_size, (QUALITY_PROMPTS, 8), generator=torch.Generator().manual_seed(0)
    )
    same = 0
    worst = 0.0
    for prompt in prompts.split(1):
        same += torch.equal(
            generate(ours, prompt, QUALITY_TOKENS), generate(bf16_weights, prompt, QUALITY_TOKENS)
        )
        with torch.no_grad():
            full, half = ours(prompt)[0, -1], bf16_weights(prompt)[0, -1].float()
        worst = max(worst, float((half - full).abs().max() / full.std()))
    return (
        f"bf16 weights against fp32: the first {QUALITY_TOKENS} greedy tokens equal on {same} of "
        f"{QUALITY_PROMPTS} fixed random prompts; largest logit difference {worst:.3f} of the logits' spread"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (default: %(default)s)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="new tokens (default: 100 900)")
    parser.add_argument(
        "--book-max", type=int, default=100, help="the book's loop runs up to this many tokens"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer, 64-dim model, context 64, 1,000 ids: a smoke run"
    )
    parser.add_argument(
        "--bf16-weights",
        choices=["auto", "on", "off"],
        default="auto",
        help="the bf16 weights' row: auto runs it where bf16 is fast (AMX or AVX-512 BF16) and with --tiny; "
        "on an AVX2-only CPU bf16 is emulated (~3 tokens/s: minutes at 900 tokens), and the inference "
        "precision `auto` answers in fp32 there",
    )
    args = parser.parse_args()
    lengths = args.lengths or ([8, 40] if args.tiny else [100, 900])
    dims = (
        {"emb_dim": 64, "n_layers": 2, "n_heads": 2, "context_length": 64, "vocab_size": 1000}
        if args.tiny
        else {}
    )
    cfg = ModelConfig.from_preset("gpt2-small", drop_rate=0.0, qkv_bias=True, attention="sdpa", **dims)
    ours, theirs = build_models(cfg)
    with_bf16 = args.bf16_weights == "on" or (
        args.bf16_weights == "auto" and (args.tiny or bf16_is_fast(torch.device("cpu")))
    )
    bf16_weights = copy.deepcopy(ours).to(torch.bfloat16) if with_bf16 else None
    runs = variants(ours, theirs, bf16_weights)
    idx = torch.tensor([PROMPT]) % cfg.vocab_size  # (1, 4); --tiny has a small vocabulary
    print(
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; emb {cfg.emb_dim} x {cfg.n_layers} "
        f"layers, context {cfg.context_length}; prompt {len(PROMPT)} tokens, greedy; median of {args.rounds} rounds"
    )
    plan = [(name, n) for n in lengths for name in runs if not name.startswith("book") or n <= args.book_max]
    for name, n in plan:  # warm-up, and the tokens to compare
        runs[name](idx, min(n, 4))
    seconds: dict[tuple[str, int], list[float]] = {key: [] for key in plan}
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(args.rounds):
        for name, n in plan:
            start = time.perf_counter()
            out = runs[name](idx, n)
            seconds[name, n].append(time.perf_counter() - start)
            tokens[name, n] = out[0, len(PROMPT) :].tolist()
            assert len(tokens[name, n]) == n, f"{name} made {len(tokens[name, n])} of {n} tokens"
    print(
        f"{'variant':<24} {'new tokens':>10} {'s':>8} {'tokens/s':>9} {'vs transformers':>16} {'same tokens':>12}"
    )
    for name, n in plan:
        median = statistics.median(seconds[name, n])
        reference = statistics.median(seconds["transformers generate", n])
        same = tokens[name, n] == tokens["transformers generate", n]
        print(
            f"{name:<24} {n:>10} {median:>8.2f} {n / median:>9.1f} {reference / median:>15.2f}x {str(same):>12}"
        )
    if bf16_weights is None:
        print("bf16 weights: not run, bf16 is not fast on this CPU (--bf16-weights on runs them)")
    else:
        print(bf16_quality(ours, bf16_weights))


if __name__ == "__main__":
    main()
