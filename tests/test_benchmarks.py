"""The benchmarks run and print every row; their speed lives in benchmarks/README.md, not here."""

from __future__ import annotations

import subprocess
import sys

from helpers import PROJECT_ROOT


def test_train_step_benchmark_tiny_prints_every_variant() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_train_step.py", "--tiny", "--rounds", "2"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    table = result.stdout[result.stdout.index("variant") :].splitlines()[1:]
    for name in (
        "book (ch. 4 model, AdamW)",
        "ours, default params",
        "ours, fast profile",
        "transformers GPT2LMHeadModel",
        "the fp32 GEMM limit",
    ):
        (row,) = [line for line in table if line.startswith(name)]
        seconds, tokens_per_second = (float(v) for v in row[len(name) :].split()[:2])
        assert seconds > 0 and tokens_per_second > 0, row
    assert "step FLOPs = 6 * N * tokens" in result.stdout


def test_bench_generate_tiny_prints_every_variant_with_the_same_tokens() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_generate.py", "--tiny", "--rounds", "1"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.startswith(("ours", "transformers", "book"))
    ]
    assert [(row[0], row[-5]) for row in rows] == [
        ("ours", "8"),
        ("transformers", "8"),
        ("book", "8"),
        ("ours", "40"),
        ("transformers", "40"),
        ("book", "40"),
    ]
    assert all(row[-1] == "True" for row in rows), result.stdout  # greedy tokens equal transformers'
    assert all(float(row[-3]) > 0 for row in rows)
