"""Model FLOPs utilisation: what share of the device's peak a training run's tokens/s amount to.

A training token costs 6 FLOPs per weight (forward 2, backward 4) plus attention's
12 x layers x embedding x context (PaLM's appendix B, as nanoGPT and the book's
speed bonus count it). The peak is the vendor's dense figure for the precision the
run's matmuls use; devices not in the table (CPUs among them) have no MFU.
"""

from __future__ import annotations

import torch

from gptlab.model.config import ModelConfig

# Dense peak FLOP/s by GPU name fragment: bf16 tensor cores, and fp32 matmuls through TF32.
PEAK_FLOPS = {
    "H200": {"bf16": 989.4e12, "fp32": 494.7e12},
    "H100": {"bf16": 989.4e12, "fp32": 494.7e12},  # SXM; the PCIe card's figures are lower
    "A100": {"bf16": 312e12, "fp32": 156e12},
}


def flops_per_token(model: ModelConfig, parameters: int) -> float:
    """Training FLOPs of one token of a model with `parameters` weights at its context length."""
    return 6 * parameters + 12 * model.n_layers * model.emb_dim * model.context_length


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak at `precision` (bf16 or fp32), if known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks[precision] for key, peaks in PEAK_FLOPS.items() if key in name), None)


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """The share of `peak` that `tokens_per_second` uses (None where the peak is unknown)."""
    return tokens_per_second * flops_per_token / peak if peak else None
