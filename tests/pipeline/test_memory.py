"""Keeping freed memory (gptlab.memory): large blocks stay in the heap, and no number changes.

Each check runs in a fresh interpreter: malloc's settings are the process's, so the
test process itself is left as it was, and each side starts from glibc's defaults.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from gptlab.pipeline.memory import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# A 64 MB block, above glibc's largest mmap threshold (32 MB): what the heap holds around its life.
HEAP_AROUND_A_BLOCK = """
import ctypes, json, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def heap():
    info = libc.mallinfo2()
    return {"mmapped": info.hblkhd, "free_in_heap": info.fordblks}

def main():
    before = heap()
    block = torch.ones(16 * 2**20)  # 64 MB
    alive = heap()
    del block
    print(json.dumps({"before": before, "alive": alive, "freed": heap()}))

mode = sys.argv[1]
if mode != "plain":  # a stage script's first line, run as a script or imported
    from gptlab.pipeline.stage import answer_arguments_first
    sys.argv = [sys.argv[0]]
    answer_arguments_first("__main__" if mode == "script" else "stages.pretrain", None)
main()
"""


def heap_around_a_block(tmp_path: Path, mode: str) -> dict[str, dict[str, int]]:
    script = tmp_path / "heap.py"
    script.write_text(HEAP_AROUND_A_BLOCK)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def mapped_while_alive(heap: dict[str, dict[str, int]]) -> int:
    return heap["alive"]["mmapped"] - heap["before"]["mmapped"]


@pytest.mark.slow
def test_a_stage_process_serves_large_blocks_from_the_heap_and_keeps_them_when_freed(
    tmp_path: Path,
) -> None:
    if not GLIBC:  # the settings are glibc's: elsewhere nothing changes, and it says so
        assert keep_freed_memory() is False
        return
    for mode in ("plain", "imported"):  # glibc's default, and a stage script imported (by tests)
        heap = heap_around_a_block(tmp_path, mode)
        assert mapped_while_alive(heap) >= 64 * 2**20, mode  # the block gets its own mmap ...
        assert heap["freed"]["mmapped"] == heap["before"]["mmapped"], mode  # ... unmapped on free
    heap = heap_around_a_block(tmp_path, "script")
    assert mapped_while_alive(heap) == 0  # from the heap
    kept = heap["freed"]["free_in_heap"] - heap["before"]["free_in_heap"]
    assert kept >= 60 * 2**20  # and kept there for the next block (glibc trims at 128 kB by default)


# Three AdamW steps of a small GPT-2 (its 50,257-row embedding and head are mmap'ed by glibc's defaults),
# and the digest of its weights' bytes.
THREE_STEPS = """
import hashlib, json, sys
import torch
from gptlab.pipeline.memory import keep_freed_memory
from gptlab.model.config import ModelConfig
from gptlab.training.chunked_loss import language_model_loss
from gptlab.model.build import build_gpt

if sys.argv[1] == "kept":
    assert keep_freed_memory()
torch.manual_seed(123)
cfg = ModelConfig(context_length=32, emb_dim=64, n_heads=2, n_layers=2, kernels=sys.argv[2])
model = build_gpt(cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
loss_fn = language_model_loss(sys.argv[3])
ids = torch.randint(0, 50257, (4, 33))
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = loss_fn(model, (ids[:, :-1], ids[:, 1:]))
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(json.dumps({"losses": losses, "weights": weights}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("kernels", "loss_kernel"), [("book", "book"), ("fused", "chunked")])
def test_keeping_freed_memory_changes_no_number(tmp_path: Path, kernels: str, loss_kernel: str) -> None:
    script = tmp_path / "steps.py"
    script.write_text(THREE_STEPS)
    runs = {
        mode: subprocess.run(
            [sys.executable, str(script), mode, kernels, loss_kernel],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for mode in (("kept", "plain") if GLIBC else ("plain",))
    }
    results = [json.loads(out.splitlines()[-1]) for out in runs.values()]
    assert results[0]["losses"][0] > results[0]["losses"][-1]  # it trained
    assert all(result == results[0] for result in results)  # bit for bit
