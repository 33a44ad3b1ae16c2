"""benchmarks/bench_finetune.py runs both fine-tunes (default and fast) and reports every figure per unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("spam-finetune", "instruct-finetune")
FIGURES = ("seconds_per_step", "seconds_per_evaluation", "seconds_per_answer", "wall_seconds", "peak_rss_gb")
HEADINGS = ("stage", "variant", "s/step", "s/eval", "s/answer", "wall", "peak RSS")


@pytest.mark.slow
def test_the_finetune_benchmark_reports_every_stage_and_variant_per_unit(
    shared_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_finetune.py",
            "--smoke",
            "--max-steps",
            "6",
            "--answer-tokens",
            "8",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=os.environ,  # GPTLAB_MIRROR: the tests' cache of the pinned inputs
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["stage"], row["variant"]): row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == [(s, v) for s in STAGES for v in ("default", "fast", "fast/default")]
    for (stage, variant), row in rows.items():
        answered = stage == "instruct-finetune"
        for figure in FIGURES:
            if figure == "seconds_per_answer" and not answered:
                assert row[figure] is None, (stage, variant)  # spam answers nothing
            else:
                assert row[figure] > 0, (stage, variant, figure)
        if variant == "fast/default":
            for figure in FIGURES:
                fast, default = rows[stage, "fast"][figure], rows[stage, "default"][figure]
                assert row[figure] == (fast / default if default else None)
            continue
        assert row["steps"] == 6  # the cap, below either stage's full run of the smoke data
        assert row["evaluations"] >= 1
        if answered:  # every test record (their tokens re-encoded from the text: a rough count)
            assert row["answers"] > 0 and row["answer_tokens"] >= 0
        else:
            assert row["answers"] is None and row["answer_tokens"] is None
        assert row["phases"]["step"] <= row["training_seconds"] < row["wall_seconds"]
    header, *lines = done.stdout.splitlines()[1:8]
    assert header.split()[:2] == ["stage", "variant"] and all(h in header for h in HEADINGS)
    assert [line.split()[:2] for line in lines] == [[s, v] for s, v in rows]
    assert all(len(line.split()) == len(HEADINGS) for line in lines)  # a cell in every column
    assert "load average before" in done.stdout
