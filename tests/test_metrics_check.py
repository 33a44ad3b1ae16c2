"""The metric guard that CI runs after the smoke profile: regressions fail, improvements pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gptlab.cli import main
from gptlab.metrics_check import compare, load_baseline, update_baseline
from gptlab.typed_config import ConfigError


def write_reports(root: Path, val_loss: float, accuracy: float) -> Path:
    reports = root / "reports"
    (reports / "pretrain").mkdir(parents=True, exist_ok=True)
    (reports / "spam").mkdir(parents=True, exist_ok=True)
    (reports / "pretrain" / "metrics.json").write_text(json.dumps({"val_loss": val_loss, "steps": 10}))
    (reports / "spam" / "metrics.json").write_text(json.dumps({"test": {"accuracy": accuracy}}))
    return reports


@pytest.fixture
def baseline(tmp_path: Path) -> Path:
    path = tmp_path / "baseline.yaml"
    path.write_text(
        "# guarded metrics\n"
        + yaml.safe_dump(
            {
                "metrics": {
                    "pretrain/metrics.json": {
                        "val_loss": {"baseline": 6.0, "direction": "lower", "tolerance": 0.05}
                    },
                    "spam/metrics.json": {
                        "test.accuracy": {"baseline": 0.9, "direction": "higher", "tolerance": 0.01}
                    },
                }
            }
        )
    )
    return path


def statuses(baseline: Path, reports: Path) -> dict[str, str]:
    return {row.metric: row.status for row in compare(load_baseline(baseline), reports)}


def test_within_tolerance_passes_and_regressions_fail(tmp_path: Path, baseline: Path) -> None:
    assert statuses(baseline, write_reports(tmp_path, 6.04, 0.895)) == {
        "val_loss": "ok",
        "test.accuracy": "ok",
    }
    assert statuses(baseline, write_reports(tmp_path, 6.06, 0.95)) == {
        "val_loss": "regressed",
        "test.accuracy": "improved",
    }
    assert statuses(baseline, write_reports(tmp_path, 5.0, 0.85))["test.accuracy"] == "regressed"


def test_cli_exit_codes_and_table(tmp_path: Path, baseline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = write_reports(tmp_path, 5.9, 0.91)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 0
    out = capsys.readouterr().out
    assert "| pretrain/metrics.json | val_loss | 6 | 5.9 | -0.1 | lower | 0.05 | improved |" in out

    reports = write_reports(tmp_path, 7.0, 0.91)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 1
    assert "FAILED: 1 of 2" in capsys.readouterr().out


def test_missing_metric_fails(tmp_path: Path, baseline: Path) -> None:
    reports = write_reports(tmp_path, 6.0, 0.9)
    (reports / "spam" / "metrics.json").unlink()
    rows = compare(load_baseline(baseline), reports)
    assert [row.failed for row in rows] == [False, True]


def test_update_baseline_keeps_direction_and_tolerance(tmp_path: Path, baseline: Path) -> None:
    reports = write_reports(tmp_path, 7.25, 0.5)
    update_baseline(baseline, reports)
    assert baseline.read_text().startswith("# guarded metrics\n")
    updated = load_baseline(baseline)
    assert updated["pretrain/metrics.json"]["val_loss"].baseline == 7.25
    assert updated["spam/metrics.json"]["test.accuracy"].direction == "higher"
    assert updated["spam/metrics.json"]["test.accuracy"].tolerance == 0.01
    assert all(row.status == "ok" for row in compare(updated, reports))


def test_bad_baseline_entry_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump({"metrics": {"a.json": {"loss": {"baseline": 1.0, "direction": "down"}}}}))
    with pytest.raises(ConfigError, match=r"metrics\.a\.json\.loss\.direction"):
        load_baseline(path)
