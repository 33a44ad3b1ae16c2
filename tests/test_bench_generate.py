"""The generation benchmark runs end to end (--tiny) and prints its table; no timings are asserted."""

from __future__ import annotations

import subprocess
import sys

from helpers import PROJECT_ROOT


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
