"""`gptlab smoke`'s dvc: the first run's "No file hash info found" lines go, everything else stays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NOISE = "No file hash info found"


def fresh_repo(root: Path) -> Path:
    """A git + DVC repository with one stage that has never run (no dvc.lock)."""
    root.mkdir()
    (root / "params.yaml").write_text("x: 1\n")
    (root / "dvc.yaml").write_text(
        "stages:\n  make:\n    cmd: python -c \"print('stage ran'); open('out.txt', 'w').write('1')\"\n"
        "    params: [x]\n    outs: [out.txt]\n"
    )
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"]):
        subprocess.run(command, cwd=root, check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "commit", "-qm", "fresh"], cwd=root, check=True)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("quiet", [False, True], ids=["dvc", "gptlab.pipeline.dvc_quiet"])
def test_a_first_experiment_warns_only_through_plain_dvc(tmp_path: Path, quiet: bool) -> None:
    repo = fresh_repo(tmp_path / "repo")
    dvc = [sys.executable, "-m", "gptlab.pipeline.dvc_quiet"] if quiet else ["dvc"]
    done = subprocess.run([*dvc, "exp", "run", "--name", "first"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (NOISE in done.stderr + done.stdout) is not quiet
    assert "stage ran" in done.stdout and "Ran experiment(s): first" in done.stdout
    assert (repo / "out.txt").read_text() == "1"
