"""The benchmarks run and print every row; their speed lives in benchmarks/README.md, not here."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from gptlab.training.runtime import bf16_is_fast
from tests.pipeline.test_memory import GLIBC

from helpers import PROJECT_ROOT

KEPT = "freed memory kept, as the stages do" if GLIBC else "freed memory as this platform's malloc does"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "memory"), [([], KEPT), (["--glibc-malloc"], "freed memory returned (glibc defaults)")]
)
def test_train_step_benchmark_tiny_prints_every_variant(flags: list[str], memory: str) -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_train_step.py", "--tiny", "--rounds", "2", *flags],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    assert memory in result.stdout.splitlines()[0]
    table = result.stdout[result.stdout.index("variant") :].splitlines()[1:]
    names = [
        "book (ch. 4 model, AdamW)",
        "ours, default params",
        "ours, fast profile",
        "transformers GPT2LMHeadModel",
        "the fp32 GEMM limit",
    ]
    if bf16_is_fast(torch.device("cpu")):  # the fast profile runs bf16: fp32 is compared too
        names += ["ours, fast profile, fp32", "transformers, fp32", "the bf16 GEMM limit"]
    assert len(table) == len(names), result.stdout
    for name in names:
        (row,) = [line for line in table if line[:30].rstrip() == name]
        seconds, tokens_per_second = (float(v) for v in row[len(name) :].split()[:2])
        assert seconds > 0 and tokens_per_second > 0, row
    assert "step FLOPs = 6 * N * tokens" in result.stdout


@pytest.mark.slow
def test_bench_generate_tiny_prints_every_variant_with_the_same_tokens() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_generate.py", "--tiny", "--rounds", "1"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    names = [
        "ours (KV cache)",
        "ours, book kernels",
        "ours, bf16 weights",
        "transformers generate",
        "book (no cache)",
    ]
    rows = [
        (line[:24].rstrip(), *line[24:].split())
        for line in result.stdout.splitlines()
        if line.startswith(("ours", "transformers", "book"))
    ]
    assert [(row[0], row[1]) for row in rows] == [(name, n) for n in ("8", "40") for name in names], (
        result.stdout
    )
    # greedy fp32 tokens equal transformers' (bf16 weights may round onto other tokens)
    assert all(row[-1] == "True" for row in rows if "bf16" not in row[0]), result.stdout
    assert all(float(row[3]) > 0 for row in rows)
    quality = re.search(
        r"tokens equal on (\d+) of 16 fixed random prompts; largest logit difference ([\d.]+)", result.stdout
    )
    assert quality is not None, result.stdout
    assert 0 <= int(quality[1]) <= 16 and 0 < float(quality[2]) < 1


@pytest.mark.slow
def test_bench_corpus_pretrain_tiny_prints_every_variant() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_corpus_pretrain.py",
            "--tiny",
            "--book",
            "--rounds",
            "1",
            "--steps",
            "1",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    table = result.stdout[result.stdout.index("variant") :].splitlines()[1:]
    names = [
        "ours, corpus (memory-mapped shards)",
        "ours, Verdict path (ids in memory)",
        "book (speed bonus, bf16 weights)",
    ]
    assert [row[:38].rstrip() for row in table] == names, result.stdout
    for row in table:
        seconds, tokens_per_second = (float(v.replace(",", "")) for v in row[38:].split()[:2])
        assert seconds > 0 and tokens_per_second > 0, row
    assert table[-1].split()[-3] == "1.00x"  # the book is the baseline


@pytest.mark.parametrize("steps", [["5"], ["1", "0"], ["1,2"]])
def test_the_gpu_check_refuses_a_step_it_lacks_in_one_line_before_looking_for_a_gpu(steps: list[str]) -> None:
    result = subprocess.run(
        ["bash", "benchmarks/gpu.sh", *steps], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"gpu.sh: no step '{steps[-1]}': the steps are 1 to 4 (see the top of benchmarks/gpu.sh)\n"
    )
    assert result.stdout == ""
