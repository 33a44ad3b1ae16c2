"""`gptlab compare` against the real dvc: experiments in a few columns, never the deps' hashes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gptlab.cli.main import main
from gptlab.experiments.compare import compare, exp_show, headline_metrics, text_table
from gptlab.experiments.profiles import dvc_executable

from helpers import dvc, dvc_exp_show, git

pytestmark = pytest.mark.slow  # the real dvc binary

# A stage that reads two params (one of them never changed) and imports a helper module, so DVC's
# own table has param, metric and dependency-hash columns; only the loss is a headline metric.
TRAIN = """\
import json, os
import yaml
from helper import score
params = yaml.safe_load(open("params.yaml"))
os.makedirs("reports/train", exist_ok=True)
with open("reports/train/metrics.json", "w") as f:
    json.dump({"loss": 1 / params["x"], "scores": {"acc": score(params["x"])}, "steps": 10 * params["x"]}, f)
"""
DVC_YAML = """\
stages:
  train:
    cmd: python train.py
    deps: [train.py, helper.py]
    params: [x, seed]
    metrics:
      - reports/train/metrics.json:
          cache: false
"""
BASELINE = """\
metrics:
  train/metrics.json:
    loss: {baseline: 1.0, direction: lower, tolerance: 0.01}
    scores.acc: {baseline: 0.5, direction: higher, tolerance: 0.03}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed one-stage DVC project with two experiments, x=2 (named two) and x=4."""
    root = tmp_path_factory.mktemp("compare")
    (root / "params.yaml").write_text("x: 1\nseed: 123\n")
    (root / "train.py").write_text(TRAIN)
    (root / "helper.py").write_text("def score(x):\n    return x / (x + 1)\n")
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "baselines").mkdir()
    (root / "baselines" / "tiny.yaml").write_text(BASELINE)
    git(root, "init", "-q")
    dvc(root, "init", "-q")
    dvc(root, "repro", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "baseline")
    dvc(root, "exp", "run", "-q", "--name", "two", "-S", "x=2")
    dvc(root, "exp", "run", "-q", "-S", "x=4")
    return root


def compare_output(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["compare", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_rows_are_the_commit_and_its_experiments_with_the_changed_param_and_the_headline_metrics(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = compare_output(capsys, "-C", str(project))
    assert code == 0
    header, *lines = out.splitlines()
    assert header.split() == ["experiment", "rev", "created", "x", "train/loss", "train/scores.acc"]
    rows = {line.split()[0]: line.split() for line in lines}
    branch = subprocess.run(
        ["git", "branch", "--show-current"], cwd=project, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert len(lines) == 3 and branch in rows and "two" in rows
    # x and the loss 1/x, per row; the unnamed experiment is the third, x=4.
    assert rows[branch][4:] == ["1", "1", "0.5"]
    assert rows["two"][4:] == ["2", "0.5", "0.66667"]
    (other,) = set(rows) - {branch, "two"}
    assert rows[other][4:] == ["4", "0.25", "0.8"]
    # DVC's own table for the same project: the deps' hashes, the unchanged seed, the non-headline steps.
    shown = dvc_exp_show(project, "--csv").splitlines()[0].split(",")
    assert {"train.py", "helper.py", "seed", "steps"} <= set(shown)
    assert not {"train.py", "helper.py", "seed", "steps"} & set(header.split())


def test_markdown_and_json_hold_the_same_rows(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, md, _ = compare_output(capsys, "--workdir", str(project), "--md", "--precision", "2")
    lines = md.splitlines()
    assert lines[0] == "| experiment | rev | created | x | train/loss | train/scores.acc |"
    assert lines[1] == "|---|---|---|---|---|---|" and len(lines) == 5
    assert any(line.startswith("| two |") and line.endswith("| 2 | 0.5 | 0.67 |") for line in lines)
    _, text, _ = compare_output(capsys, "-C", str(project), "--json")
    records = json.loads(text)
    assert [r["x"] for r in records][0] == 1 and sorted(r["x"] for r in records) == [1, 2, 4]
    assert {r["experiment"]: r["train/scores.acc"] for r in records}["two"] == pytest.approx(2 / 3)
    assert all(len(r["rev"]) == 7 for r in records)


def test_a_narrow_terminal_gets_one_line_per_column(project: Path) -> None:
    comparison = compare(
        exp_show(project, dvc_executable()), headline_metrics([project / "baselines/tiny.yaml"])
    )
    wide = text_table(comparison, 5, 200)
    narrow = text_table(comparison, 5, 50)
    assert len(wide.splitlines()) == 4 and max(map(len, wide.splitlines())) > 50
    assert max(map(len, narrow.splitlines())) <= 50
    # Tall: a line per column, the experiments side by side (in blocks, each naming the columns again).
    labels = [line.split()[0] for line in narrow.splitlines() if line.strip()]
    assert {"rev", "created", "x", "train/loss", "train/scores.acc"} <= set(labels)
    assert "two" in narrow and "0.66667" in narrow


def test_without_experiments_the_commit_is_the_one_row_and_workspace_edits_a_second(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    clone = tmp_path / "clone"  # a clone has the commit (metrics included) but not the experiments
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    _, out, _ = compare_output(capsys, "-C", str(clone))
    header, *lines = out.splitlines()
    assert len(lines) == 1 and header.split()[3:] == ["train/loss", "train/scores.acc"]
    (clone / "params.yaml").write_text("x: 8\nseed: 123\n")
    _, out, _ = compare_output(capsys, "-C", str(clone))
    header, *lines = out.splitlines()
    assert header.split()[3] == "x" and [line.split()[0] for line in lines][0] == "workspace"
    assert lines[0].split()[1:3] == ["workspace", "8"]


def test_outside_a_dvc_project_and_when_dvc_fails_the_error_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = compare_output(capsys, "-C", str(tmp_path))
    assert code == 2 and not out
    assert err.count("\n") == 1 and f"{tmp_path} is not in a DVC project" in err
    dvc(tmp_path, "init", "-q", "--no-scm")  # DVC without git has no experiments
    code, _, err = compare_output(capsys, "-C", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert "`dvc exp show` failed" in err and "Only supported for Git repositories" in err


def test_a_commit_without_a_baseline_file_names_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    git(tmp_path, "init", "-q")
    dvc(tmp_path, "init", "-q")
    code, _, err = compare_output(capsys, "-C", str(tmp_path))
    assert code == 2 and "no git commit yet" in err
    git(tmp_path, "commit", "-qm", "dvc init")
    code, _, err = compare_output(capsys, "-C", str(tmp_path))
    assert code == 2 and f"no metrics baseline in {tmp_path / 'baselines'}" in err
