"""The benchmarks run and print every row; their speed lives in benchmarks/README.md, not here."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import PROJECT_ROOT


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
