"""Where and how tensors run: the device, the precision, and batches in a fixed order.

Shared by training, evaluation and the CLI, so none of them needs the training
loop to pick a device or read a dataset in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from gptlab.errors import InputError
from gptlab.training import distributed

Precision = Literal["fp32", "bf16", "auto"]


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """The device for `key` (a param, or a CLI flag): auto picks cuda, then mps, then cpu (this rank's
    GPU under torchrun)."""
    if name == "auto":
        if torch.cuda.is_available():
            return distributed.local_device(torch.device("cuda"))
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{key}: cuda was requested but no CUDA device is available; use auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"{key}: mps was requested but MPS is not available; use auto or cpu")
    if name not in ("cpu", "cuda", "mps"):
        raise InputError(f"{key}: expected auto, cpu, cuda or mps, got {name!r}")
    return distributed.local_device(torch.device(name))


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 matmuls beat fp32 here: a CUDA GPU with bf16, or a CPU with AMX or AVX-512 BF16
    whose AVX-512 kernels torch runs.

    Elsewhere (an AVX2-only CPU, for one) bf16 is emulated: its matmuls run about 6x slower than fp32.
    So it is where torch is held to AVX2 on such a CPU (ATEN_CPU_CAPABILITY=avx2, to get an AVX2
    machine's numbers, say): the instructions are there, but not the kernels that use them.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        has_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
        return has_bf16 and torch.backends.cpu.get_cpu_capability() == "AVX512"
    return False


def resolve_precision(device: torch.device, precision: Precision) -> Literal["fp32", "bf16"]:
    """What `train.precision` means on `device`: auto is bf16 where bf16 is fast, fp32 elsewhere."""
    if precision == "auto":
        return "bf16" if bf16_is_fast(device) else "fp32"
    return precision


def use_precision(device: torch.device, precision: Precision) -> Literal["fp32", "bf16"]:
    """Resolve `precision` for a run; under auto on CUDA, fp32 matmuls left outside autocast use TF32."""
    if precision == "auto" and device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # also sets torch.backends.cuda.matmul.allow_tf32
    return resolve_precision(device, precision)


def inference_dtype(device: torch.device, precision: Precision) -> torch.dtype:
    """The weights' dtype for answering at `precision` (auto: bf16 where bf16 is fast, fp32 elsewhere).

    bf16 weights, not autocast: autocast casts every weight again at every decoding step,
    which at one token a step is slower than fp32 (see benchmarks/README.md).
    """
    return torch.bfloat16 if resolve_precision(device, precision) == "bf16" else torch.float32


def autocast(device: torch.device, precision: Precision) -> torch.autocast:
    """The autocast context for `precision`: bf16 mixed precision, or a no-op for fp32."""
    enabled = resolve_precision(device, precision) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor moved to `device` (tuples, lists and dicts are walked).

    To a GPU through pinned host memory, without waiting: the copy overlaps the work queued
    before it, and the GPU's stream orders it before the kernels that read it.
    """
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def ordered_loader(
    dataset: Dataset, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None
) -> DataLoader:
    """Batches in dataset order, the last partial one kept: for evaluation.

    The loader has its own generator, so iterating it never draws from the
    global RNG (which would shift dropout masks and break exact resume).
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        collate_fn=collate_fn,
        generator=torch.Generator(),
    )
