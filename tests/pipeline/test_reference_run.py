"""The committed reference run (dvc.lock, reports/): what a fresh clone's DVC reads of it loads cleanly.

The reference run covers download → eval; the stages after it need OpenAI's weights. Their
declared metrics and plots files are committed empty (`{}`, a CSV header), so `dvc metrics diff`
and `dvc plots diff` on a fresh clone load every file, and no value is claimed for a stage that
did not run.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import PROJECT_ROOT


def dvc_yaml() -> dict[str, Any]:
    return yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text(encoding="utf-8"))


def _paths(entries: list[Any]) -> list[str]:
    return [next(iter(entry)) if isinstance(entry, dict) else entry for entry in entries]


def declared_files() -> dict[str, str]:
    """Every metrics and plots file dvc.yaml declares -> the stage that writes it."""
    pipeline = dvc_yaml()
    owner: dict[str, str] = {}
    for name, stage in pipeline["stages"].items():
        for path in (
            _paths(stage.get("outs", [])) + _paths(stage.get("metrics", [])) + _paths(stage.get("plots", []))
        ):
            owner[path] = name
    files = {}
    for name, stage in pipeline["stages"].items():
        for path in _paths(stage.get("metrics", [])) + _paths(stage.get("plots", [])):
            files[path] = name
    for path in _paths(pipeline.get("plots", [])):
        files[path] = owner[path]
    return files


def committed() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    return set(listed.stdout.splitlines())


def test_every_metrics_and_plots_file_dvc_reads_is_committed() -> None:
    missing = sorted(set(declared_files()) - committed())
    assert missing == [], "dvc metrics/plots diff on a fresh clone would fail to load these"


def test_a_stage_outside_the_reference_run_claims_no_value() -> None:
    ran = set(yaml.safe_load((PROJECT_ROOT / "dvc.lock").read_text(encoding="utf-8"))["stages"])
    assert {"download", "tokenize", "pretrain", "eval"} <= ran
    columns_read = {
        path: {spec["x"], *spec["y"]} for entry in dvc_yaml()["plots"] for path, spec in entry.items()
    }
    columns_read["reports/spam/predictions.csv"] = {"actual", "predicted"}  # the confusion plot's x and y
    for path, stage in declared_files().items():
        file = PROJECT_ROOT / path
        if stage in ran:
            assert file.stat().st_size > 0, path
        elif path.endswith(".json"):
            assert json.loads(file.read_text(encoding="utf-8")) == {}, path
        else:
            rows = list(csv.reader(file.read_text(encoding="utf-8").splitlines()))
            assert len(rows) == 1 and columns_read[path] <= set(rows[0]), path


@pytest.mark.slow
def test_a_fresh_clone_loads_every_metric_and_plot(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(PROJECT_ROOT), str(clone)], check=True)
    for command in (
        ["metrics", "show"],
        ["metrics", "diff"],
        ["plots", "diff", "-o", str(tmp_path / "plots")],
    ):
        done = subprocess.run(["dvc", *command], cwd=clone, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "failed to load" not in done.stderr + done.stdout, (command, done.stderr)
