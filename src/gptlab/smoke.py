"""Run the whole DAG on a small profile: the quick start, and what CI guards.

A profile is a YAML file of overrides laid out like params.yaml. It runs in a
separate workspace (default `.gptlab/<profile>/`: a fresh git repository with
a copy of the project's tracked files) through `dvc exp run -S ...`, so DVC
records exactly which params were used, while the project's own params.yaml,
outputs and dvc.lock stay untouched.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from gptlab.errors import GptlabError
from gptlab.paths import REPORTS
from gptlab.profiles import experiment_env, load_overrides, set_arguments

DEFAULT_PROFILE = Path("profiles/smoke.yaml")
# Where `gptlab smoke` runs by default (project-relative): its models are under models/ there.
SMOKE_WORKDIR = Path(".gptlab") / DEFAULT_PROFILE.stem


def smoke_model_hint(command: str, model: Path, raw_dir: Path) -> str:
    """The exact command that uses the smoke run's model instead, when a smoke run left one ('' if not).

    `model` and `raw_dir` are the project-relative paths the command reads by default.
    """
    smoke_model = SMOKE_WORKDIR / model
    if not (smoke_model / "config.json").is_file():
        return ""
    return (
        f"; to use the model of the last `gptlab smoke` run instead: "
        f"gptlab {command} --model {smoke_model.as_posix()} --raw-dir {(SMOKE_WORKDIR / raw_dir).as_posix()} ..."
    )


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


def source_commit_env(project: Path) -> dict[str, str]:
    """GPTLAB_SOURCE_COMMIT / GPTLAB_SOURCE_DIRTY naming the project's commit, for lineage.py to tag runs with."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=project,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"GPTLAB_SOURCE_COMMIT": commit, "GPTLAB_SOURCE_DIRTY": str(bool(status.strip())).lower()}


def run_profile(project: Path, profile: Path, workdir: Path) -> Path:
    """Run every stage with the profile's overrides; returns the workspace's reports folder."""
    overrides = load_overrides(profile, project / "params.yaml")
    prepare_workspace(project, workdir)
    # Runs land in the project's own MLflow store (not the throwaway workspace) unless told otherwise,
    # tagged with the project's own commit, not the workspace's.
    env = experiment_env(project)
    env.update(source_commit_env(project))
    result = subprocess.run(
        ["dvc", "exp", "run", "--name", profile.stem, *set_arguments(overrides)], cwd=workdir, env=env
    )
    if result.returncode:
        raise GptlabError(
            f"the {profile.stem} profile failed in {workdir} (dvc exp run exited {result.returncode})"
        )
    return workdir / REPORTS
