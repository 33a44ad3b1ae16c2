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


def test_the_stage_benchmark_runs_the_chosen_variants_beside_the_book(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--variants picks rows (the run above covers running them); the book's loop is always the yardstick."""
    monkeypatch.syspath_prepend(ROOT / "benchmarks")  # as the script itself runs: its sibling modules
    import bench_stage

    parser = bench_stage.build_parser()
    assert bench_stage.chosen(parser.parse_args([]).variants) == ("book", "book-kept", "default", "fast")
    assert bench_stage.chosen(parser.parse_args(["--variants", "fast"]).variants) == ("book", "fast")
    assert bench_stage.chosen(parser.parse_args(["--variants", "fast", "book-kept"]).variants) == (
        "book",
        "book-kept",
        "fast",
    )
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--variants", "slow"])
    assert refused.value.code == 2 and "invalid choice: 'slow'" in capsys.readouterr().err
