"""One epoch of the pretrain stage's training on The Verdict with the fast profile, and its MFU.

It runs the real training loop (`gptlab.training.loop.fit`: evaluations and
checkpoints included) with profiles/fast.yaml's pretrain settings on the
device given, and prints the loop's wall time, tokens per second and the
model FLOPs utilisation: the step FLOPs of bench_train_step.py per second
over `--peak-tflops`.

    python benchmarks/bench_pretrain_epoch.py --device cuda --peak-tflops 989   # H200, bf16 dense
    python benchmarks/bench_pretrain_epoch.py --tiny                           # a smoke run on CPU

The Verdict and GPT-2's tokenizer files are read from --raw-dir (default:
$GPTLAB_MIRROR, else data/raw; `gptlab mirror DIR` writes such a folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_train_step import FAST_PROFILE, step_flops
from gptlab.data.verdict import GPTDatasetV1, encode, split_text
from gptlab.experiments.profiles import profile_params
from gptlab.model.build import build_gpt
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.pipeline.params import PARAMS_FILE
from gptlab.training.chunked_loss import language_model_loss
from gptlab.training.loop import fit


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--raw-dir", type=Path, default=Path(os.environ.get("GPTLAB_MIRROR", "data/raw")))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, help="the device's peak (H200 bf16 dense: 989)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-dim model, context 32, 4 steps")
    args = parser.parse_args()

    params = profile_params(FAST_PROFILE, PARAMS_FILE)
    cfg = params.pretrain
    sources = params.data.sources
    tokenizer = gpt2_tokenizer(
        args.raw_dir / sources.gpt2_vocab_bpe.path, args.raw_dir / sources.gpt2_encoder_json.path
    )
    text = (args.raw_dir / sources.the_verdict.path).read_text(encoding="utf-8")
    shape = {"context_length": 32, "emb_dim": 64, "n_layers": 2, "n_heads": 2} if args.tiny else {}
    model_cfg = dataclasses.replace(cfg.model.resolve(), **shape)
    window = model_cfg.context_length
    train_cfg = dataclasses.replace(
        cfg.train, epochs=args.epochs, device=args.device, max_steps=4 if args.tiny else cfg.train.max_steps
    )
    train_text, val_text = split_text(text, params.tokenize.verdict.train_ratio)
    train_data, val_data = (
        GPTDatasetV1(encode(t, tokenizer), window, window) for t in (train_text, val_text)
    )

    torch.manual_seed(train_cfg.seed)
    model = build_gpt(model_cfg)
    with tempfile.TemporaryDirectory() as run_dir:
        result = fit(
            model,
            train_data,
            val_data,
            cfg=train_cfg,
            checkpoints=params.checkpoints,
            loss_fn=language_model_loss(train_cfg.loss_kernel),
            run_dir=Path(run_dir),
        )
    flops = step_flops(model_cfg, train_cfg.batch_size) * result.steps
    achieved = flops / result.wall_seconds
    print(
        f"{args.epochs} epoch(s), {result.steps} steps of {train_cfg.batch_size} x {window} tokens on "
        f"{args.device}: {result.wall_seconds:.2f} s in the training loop (evaluations and checkpoints "
        f"included), {result.seen_per_second:.0f} tokens/s, {achieved / 1e12:.3f} TFLOP/s; "
        f"final val loss {result.history[-1]['val_loss']:.3f}"
    )
    if args.peak_tflops:
        print(f"MFU {achieved / (args.peak_tflops * 1e12):.1%} of a {args.peak_tflops:g} TFLOP/s peak")


if __name__ == "__main__":
    main()
