"""benchmarks/bench_frozen_trunk.py times spam-finetune on both paths and finds the same outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("wall_seconds", "seconds_per_step", "seconds_per_evaluation", "rest_seconds", "peak_rss_gb")


@pytest.mark.slow
def test_the_frozen_trunk_benchmark_times_both_paths_and_compares_their_outputs(
    shared_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_frozen_trunk.py",
            "--smoke",
            "--max-steps",
            "6",
            "--against",
            "HEAD",  # the committed code: a third run, timed from outside, its reports compared
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
    report = json.loads(out.read_text())
    assert report["same_outputs"] is True
    cached, whole, head, ratio, head_ratio = report["rows"]
    paths = [row["path"] for row in report["rows"]]
    assert paths == ["cached", "whole", "HEAD", "cached/whole", "cached/HEAD"]
    assert report["against"] == "HEAD" and report["same_as_against"] is True  # the same code, the same bytes
    assert head["wall_seconds"] > 0 and head["peak_rss_gb"] > 0 and head["seconds_per_step"] is None
    assert head_ratio["wall_seconds"] == cached["wall_seconds"] / head["wall_seconds"]
    assert head_ratio["seconds_per_step"] is None
    assert cached["summary"].startswith(
        "on: the embeddings and block 0 computed once"
    )  # the smoke model: 2 blocks
    assert whole["summary"] == "off: spam.cache_frozen_trunk is false"
    assert cached["trunk_seconds"] > 0 and whole["trunk_seconds"] == 0 and ratio["trunk_seconds"] is None
    for row in (cached, whole):
        assert row["steps"] == 6 and row["evaluations"] >= 1
        assert all(row[figure] > 0 for figure in FIGURES), row
    assert all(ratio[figure] == cached[figure] / whole[figure] for figure in FIGURES)
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:7]] == paths
    assert "same outputs (metrics, reports, checkpoint) on both paths: yes" in done.stdout
    assert "same metrics and reports at HEAD as cached: yes" in done.stdout
    assert "load average before" in done.stdout
