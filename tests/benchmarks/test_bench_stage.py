"""benchmarks/bench_stage.py runs the book's loop and the pretrain stage (default and fast) and reports them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_stage_benchmark_reports_every_variant_against_the_book(
    shared_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_stage.py", "--smoke", "--epochs", "1", "--json", str(out)],
        cwd=ROOT,
        env=os.environ,  # GPTLAB_MIRROR: the tests' cache of the pinned inputs
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["book", "book-kept", "default", "fast"]
    assert rows["book"]["ratio_to_book"] == 1.0
    assert rows["book-kept"]["ratio_to_book"] == rows["book-kept"]["seconds"] / rows["book"]["seconds"]
    for name in ("default", "fast"):
        row = rows[name]
        assert row["seconds"] > 0 and row["ratio_to_book"] == row["seconds"] / rows["book"]["seconds"]
        phases = row["phases"]
        assert {
            "seconds_setup",
            "seconds_training",
            "seconds_training_step",
            "seconds_training_checkpoint",
        } <= set(phases)
        assert phases["seconds_training_step"] <= phases["seconds_training"]
        assert row["startup_and_exit_seconds"] > 0
    assert "vs book loop" in done.stdout and "load average before" in done.stdout


@pytest.mark.slow
def test_the_stage_benchmark_runs_the_chosen_variants_beside_the_book(
    shared_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "benchmarks/bench_stage.py", "--smoke", "--epochs", "1", "--json", str(out)]
    done = subprocess.run(
        [*command, "--variants", "fast"],
        cwd=ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["book", "fast"]
    assert rows[1]["ratio_to_book"] == rows[1]["seconds"] / rows[0]["seconds"]
    refused = subprocess.run([*command, "--variants", "slow"], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and "invalid choice: 'slow'" in refused.stderr
