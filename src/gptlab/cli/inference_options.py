"""What `gptlab chat` and `gptlab classify` share: where the model runs, at what precision, and its loading."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gptlab.model.gpt import GPTModel


def add_inference_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda", "mps"],
        help="where the model runs; auto: a CUDA GPU, else Apple's MPS, else the CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "auto"],
        help="the weights' precision: fp32, or bf16 (auto: bf16 where bf16 is fast, as on CPUs with "
        "AVX-512 BF16 or AMX); bf16 answers faster, and may differ (default: %(default)s)",
    )


def load_for_inference(checkpoint: Path, args: argparse.Namespace) -> tuple[GPTModel, dict[str, Any]]:
    """The checkpoint's model on --device with --precision weights (eval mode), and its metadata."""
    # torch on first use: keeps `gptlab --help` fast
    from gptlab.model.checkpoint import load_model
    from gptlab.training.runtime import inference_dtype, resolve_device

    device = resolve_device(args.device, "--device")
    model, metadata = load_model(checkpoint, device)
    return model.to(inference_dtype(device, args.precision)), metadata
