"""Run the whole DAG on a small profile: the quick start, and what CI guards.

A profile is a YAML file of overrides laid out like params.yaml. It runs in a
separate workspace (default `.gptlab/<profile>/`: a fresh git repository with
a copy of the project's tracked files) through `dvc exp run -S ...`, so DVC
records exactly which params were used, while the project's own params.yaml,
outputs and dvc.lock stay untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from gptlab.config import Params
from gptlab.errors import GptlabError
from gptlab.paths import REPORTS
from gptlab.typed_config import ConfigError, build

DEFAULT_PROFILE = Path("profiles/smoke.yaml")


def load_overrides(profile: Path, params_file: Path) -> dict[str, Any]:
    """The profile's overrides as {dotted.key: value}, checked against the full params schema."""
    if not profile.is_file():
        raise FileNotFoundError(f"profile {profile} not found")
    overrides = yaml.safe_load(profile.read_text(encoding="utf-8")) or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{profile}: expected a mapping of overrides laid out like params.yaml")
    params = yaml.safe_load(params_file.read_text(encoding="utf-8"))
    try:
        build(Params, _merge(params, overrides), "")
    except ConfigError as exc:
        raise ConfigError(f"{profile}: {exc}") from None
    return _flatten(overrides)


def prepare_workspace(project: Path, workdir: Path) -> None:
    """A fresh git repository holding the project's tracked and new (not ignored) files."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=project,
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
    if workdir.exists():
        shutil.rmtree(workdir)
    for name in filter(None, files):
        source = project / name
        if source.is_file():
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, workdir / name)
    git = ["git", "-c", "user.name=gptlab", "-c", "user.email=gptlab@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    subprocess.run([*git, "add", "-A"], cwd=workdir, check=True)
    subprocess.run([*git, "commit", "-qm", "smoke workspace"], cwd=workdir, check=True)


def run_profile(project: Path, profile: Path, workdir: Path) -> Path:
    """Run every stage with the profile's overrides; returns the workspace's reports folder."""
    overrides = load_overrides(profile, project / "params.yaml")
    prepare_workspace(project, workdir)
    env = dict(os.environ)
    # Runs land in the project's own MLflow store (not the throwaway workspace) unless told otherwise.
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{project.resolve() / 'mlflow.db'}")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    sets = [arg for key, value in overrides.items() for arg in ("-S", f"{key}={json.dumps(value)}")]
    result = subprocess.run(["dvc", "exp", "run", "--name", profile.stem, *sets], cwd=workdir, env=env)
    if result.returncode:
        raise GptlabError(
            f"the {profile.stem} profile failed in {workdir} (dvc exp run exited {result.returncode})"
        )
    return workdir / REPORTS


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


def _flatten(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat
