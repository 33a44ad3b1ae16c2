"""Helpers shared by the end-to-end tests: the project's root, a copy of its code, and git/dvc runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def copy_code(dest: Path) -> None:
    """The pipeline's definition and code (dvc.yaml, .gitignore, src/, stages/) copied into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", ".gitignore"):
        shutil.copy2(PROJECT_ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "stages"):
        shutil.copytree(PROJECT_ROOT / name, dest / name, ignore=ignore)


def git(project: Path, *args: str) -> None:
    """`git ARGS` in `project` with a throwaway identity (commits need one); fails the test on an error."""
    identity = ("-c", "user.name=gptlab tests", "-c", "user.email=tests@gptlab.invalid")
    subprocess.run(["git", *identity, *args], cwd=project, check=True, capture_output=True)


def dvc(
    project: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`dvc ARGS` in `project` (this interpreter's dvc); fails the test, with dvc's output, unless it succeeds."""
    exe = Path(sys.executable).with_name("dvc")
    proc = subprocess.run(
        [str(exe) if exe.is_file() else "dvc", *args],
        cwd=project,
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc
