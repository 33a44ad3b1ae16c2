"""The metric guard that CI runs after the smoke profile: regressions fail, improvements pass.

`gptlab metrics` exits 1 when a metric regressed or is missing and 2 when it could not check (a
malformed baseline, no reports), naming the file and writing nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gptlab.cli import smoke as smoke_command
from gptlab.cli.main import main
from gptlab.experiments import metrics_check
from gptlab.experiments.metrics_check import compare, guarded_reports, load_baseline, update_baseline
from gptlab.schema import ConfigError

from helpers import one_line_error, snapshot


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

    # A change of float noise reads 0, and long values are rounded for people.
    reports = write_reports(tmp_path, 6 - 2.67181e-07, 0.912345678)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 0
    out = capsys.readouterr().out
    assert "| val_loss | 6 | 6 | 0 | lower |" in out and "e-0" not in out
    assert "| 0.9123 | +0.0123 |" in out


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


def baseline_for(project: Path, name: str, reports: str, val_loss: float) -> Path:
    """baselines/<name>.yaml in `project`, holding the values of `reports` (project-relative)."""
    path = project / "baselines" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    guard = {"val_loss": {"baseline": val_loss, "direction": "lower", "tolerance": 0.05}}
    path.write_text(yaml.safe_dump({"reports": reports, "metrics": {"pretrain/metrics.json": guard}}))
    return path


def test_check_without_arguments_pairs_each_baseline_with_its_own_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    write_reports(tmp_path, 6.5, 0.9)  # the reference run, in reports/
    baseline_for(tmp_path, "reference", "reports", 6.5)
    smoke = baseline_for(tmp_path, "smoke", ".gptlab/smoke/reports", 3.0)
    # No smoke run yet: only the reference pair is checked, and it passes.
    assert main(["metrics", "check"]) == 0
    out = capsys.readouterr().out
    assert "OK: 1 metrics within tolerance of baselines/reference.yaml" in out and "smoke" not in out

    write_reports(tmp_path / ".gptlab" / "smoke", 3.01, 0.9)
    assert main(["metrics", "check"]) == 0
    out = capsys.readouterr().out
    assert "## .gptlab/smoke/reports against baselines/smoke.yaml" in out
    # --reports alone finds the baseline that guards it; the reference's 6.5 never meets the smoke's 3.0.
    assert main(["metrics", "check", "--reports", ".gptlab/smoke/reports"]) == 0
    assert "OK: 1 metrics within tolerance of baselines/smoke.yaml" in capsys.readouterr().out

    # A cross pair, asked for by name, is compared, but never offered as a new baseline.
    assert main(["metrics", "check", "--baseline", str(smoke), "--reports", "reports"]) == 1
    out = capsys.readouterr().out
    assert "holds the values of .gptlab/smoke/reports, not of reports" in out
    assert f"update-baseline --baseline {smoke}\n" not in out
    before = smoke.read_text()
    assert main(["metrics", "update-baseline", "--baseline", str(smoke), "--reports", "reports"]) == 2
    assert "would replace one run's baseline with another's" in capsys.readouterr().err
    assert smoke.read_text() == before
    # Its own reports, regressed: the fix offered is to update that very baseline.
    write_reports(tmp_path / ".gptlab" / "smoke", 3.5, 0.9)
    assert main(["metrics", "check", "--reports", ".gptlab/smoke/reports"]) == 1
    assert "If the change is intended: gptlab metrics update-baseline --baseline baselines/smoke.yaml" in (
        capsys.readouterr().out
    )
    assert main(["metrics", "update-baseline", "--baseline", "baselines/smoke.yaml"]) == 0
    assert load_baseline(smoke)["pretrain/metrics.json"]["val_loss"].baseline == 3.5


def test_check_without_any_run_says_what_to_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    baseline_for(tmp_path, "smoke", ".gptlab/smoke/reports", 3.0)
    assert main(["metrics", "check"]) == 2
    err = capsys.readouterr().err
    assert "no run to check" in err and ".gptlab/smoke/reports" in err and "gptlab smoke" in err
    write_reports(tmp_path / "elsewhere", 3.0, 0.9)
    assert main(["metrics", "check", "--reports", "elsewhere/reports"]) == 2
    assert "no baseline in baselines/ guards elsewhere/reports" in capsys.readouterr().err


def test_committed_baselines_each_name_their_run_and_the_reference_holds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(project)
    named = {path.name: guarded_reports(path) for path in (project / "baselines").glob("*.yaml")}
    assert named == {"smoke.yaml": Path(".gptlab/smoke/reports"), "reference.yaml": Path("reports")}
    # The committed reference run's reports pass against their own baseline.
    guarded = sum(len(guards) for guards in load_baseline(project / "baselines/reference.yaml").values())
    assert guarded >= 8  # the pretrain and eval losses and perplexities at least
    assert main(["metrics", "check", "--reports", "reports"]) == 0
    assert f"OK: {guarded} metrics within tolerance of baselines/reference.yaml" in capsys.readouterr().out


GOOD_BASELINE = {
    "metrics": {
        "pretrain/metrics.json": {"val_loss": {"baseline": 6.0, "direction": "lower", "tolerance": 0.05}}
    }
}


def write_every_report(root: Path, val_loss: float = 5.9) -> Path:
    reports = root / "reports"
    (reports / "pretrain").mkdir(parents=True, exist_ok=True)
    (reports / "spam").mkdir(parents=True, exist_ok=True)
    (reports / "eval").mkdir(parents=True, exist_ok=True)
    pretrain = {"val_loss": val_loss, "final_val_perplexity": 400.0, "steps": 10, "epochs": 1}
    (reports / "pretrain" / "metrics.json").write_text(json.dumps(pretrain))
    spam_metrics = {"test": {"accuracy": 0.9, "f1": 0.8, "confusion_matrix": [[1, 2], [3, 4]]}}
    (reports / "spam" / "metrics.json").write_text(json.dumps(spam_metrics))
    (reports / "eval" / "metrics.json").write_text(
        json.dumps({"val_loss": 6.5, "val_perplexity": float("inf")})
    )
    return reports


@pytest.mark.parametrize(
    ("baseline_text", "message"),
    [
        ("metrics:\n  pretrain/metrics.json: {val_loss: [1, 2\n", "line 3"),
        ("metrics:\n  - just a list\n", "expected a mapping"),
        ("metrics:\n  pretrain/metrics.json: [val_loss]\n", "metrics.pretrain/metrics.json"),
        ("metrics:\n  pretrain/metrics.json:\n    val_loss: 6.0\n", "metrics.pretrain/metrics.json.val_loss"),
        ("\xff\xfe garbage", "not UTF-8"),
    ],
    ids=["yaml-syntax", "wrong-shape", "file-not-a-mapping", "guard-not-a-mapping", "binary"],
)
@pytest.mark.parametrize("action", ["check", "update-baseline"])
def test_malformed_baseline_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], baseline_text: str, message: str, action: str
) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_bytes(baseline_text.encode("latin-1"))
    reports = write_every_report(tmp_path)
    before = snapshot(tmp_path)

    assert main(["metrics", action, "--baseline", str(baseline), "--reports", str(reports)]) == 2

    line = one_line_error(capsys, "metrics")
    assert str(baseline) in line and message in line
    assert snapshot(tmp_path) == before


def test_missing_baseline_or_reports_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.yaml"
    reports = write_every_report(tmp_path)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 2
    line = one_line_error(capsys, "metrics")
    assert str(baseline) in line and f"gptlab metrics update-baseline --baseline {baseline}" in line

    baseline.write_text(yaml.safe_dump(GOOD_BASELINE))
    for action in ("check", "update-baseline"):
        nowhere = tmp_path / "nowhere"
        assert main(["metrics", action, "--baseline", str(baseline), "--reports", str(nowhere)]) == 2
        assert f"--reports {nowhere}: no such folder" in one_line_error(capsys, "metrics")
    assert baseline.read_text() == yaml.safe_dump(GOOD_BASELINE)


def test_unreadable_metrics_file_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(yaml.safe_dump(GOOD_BASELINE))
    reports = write_every_report(tmp_path)
    (reports / "pretrain" / "metrics.json").write_text('{"val_loss": 5.')
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 2
    line = one_line_error(capsys, "metrics")
    assert str(reports / "pretrain" / "metrics.json") in line and "not valid JSON" in line


def test_regression_and_missing_metric_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(yaml.safe_dump(GOOD_BASELINE))
    reports = write_every_report(tmp_path, val_loss=7.0)
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 1
    assert "regressed" in capsys.readouterr().out
    (reports / "pretrain" / "metrics.json").unlink()
    assert main(["metrics", "check", "--baseline", str(baseline), "--reports", str(reports)]) == 1
    assert "missing" in capsys.readouterr().out


def test_update_baseline_creates_a_new_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = write_every_report(tmp_path)
    new = tmp_path / "baselines" / "new.yaml"

    assert main(["metrics", "update-baseline", "--baseline", str(new), "--reports", str(reports)]) == 0
    assert f"created {new}" in capsys.readouterr().out

    guards = load_baseline(new)
    assert set(guards) == {"pretrain/metrics.json", "spam/metrics.json", "eval/metrics.json"}
    assert set(guards["pretrain/metrics.json"]) == {"val_loss", "final_val_perplexity"}  # counts left out
    loss = guards["pretrain/metrics.json"]["val_loss"]
    assert (loss.baseline, loss.direction) == (5.9, "lower") and 0 < loss.tolerance < 0.5
    accuracy = guards["spam/metrics.json"]["test.accuracy"]
    assert (accuracy.baseline, accuracy.direction, accuracy.tolerance) == (0.9, "higher", 0.03)
    assert set(guards["eval/metrics.json"]) == {"val_loss"}  # an infinite perplexity cannot be a baseline
    assert new.read_text().startswith("#")  # says how it was made and how to update it
    assert main(["metrics", "check", "--baseline", str(new), "--reports", str(reports)]) == 0


def test_update_baseline_without_any_metric_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    new = tmp_path / "new.yaml"
    assert main(["metrics", "update-baseline", "--baseline", str(new), "--reports", str(reports)]) == 2
    line = one_line_error(capsys, "metrics")
    assert str(reports) in line and "update-baseline" not in line
    assert not new.exists()


def test_smoke_command_uses_the_check_of_metrics_check() -> None:
    assert smoke_command.check is metrics_check.check


def test_a_workspace_holding_an_applied_experiment_says_so_and_how_to_check_one(
    tmp_path: Path, baseline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `dvc exp run -S` leaves the smoke workspace: its params and reports are the experiment's."""
    from helpers import git

    workspace = tmp_path / "smoke"
    reports = write_reports(workspace, 6.0, 0.9)
    (workspace / "params.yaml").write_text("pretrain:\n  train:\n    lr: 0.0004\n")
    git(workspace, "init", "-q")
    git(workspace, "add", "-A")
    git(workspace, "commit", "-qm", "smoke run")
    assert metrics_check.check(baseline, reports) == 0
    assert "differs from its last commit" not in capsys.readouterr().out

    (workspace / "params.yaml").write_text("pretrain:\n  train:\n    lr: 0.0008\n")
    write_reports(workspace, 7.0, 0.9)
    assert metrics_check.check(baseline, reports) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        f"{reports}: the workspace of {workspace}, whose params.yaml differs from its last commit "
        "(pretrain.train.lr): the DVC experiment run or applied there last, not the committed run"
    ), out
    assert (
        f"To check a given experiment: (cd {workspace} && dvc exp apply NAME) && gptlab metrics check" in out
    )
