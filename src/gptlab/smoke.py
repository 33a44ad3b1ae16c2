"""Run the whole DAG on a small profile: the quick start, and what CI guards.

A profile is a YAML file of overrides laid out like params.yaml. It runs in a
separate workspace (default `.gptlab/<profile>/`: a fresh git repository with
a copy of the project's tracked files) through `dvc exp run -S ...`, so DVC
records exactly which params were used, while the project's own params.yaml,
outputs and dvc.lock stay untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from gptlab.environment import SOURCE_COMMIT_ENV, SOURCE_DIRTY_ENV, VERBOSE_ENV
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


def prepare_workspace(project: Path, workdir: Path, source: Mapping[str, str]) -> None:
    """A fresh git repository holding the project's tracked and new (not ignored) files.

    The project's own run (dvc.lock and the stages' reports) stays behind: the workspace's
    first commit is the pipeline and its inputs, and its second (`commit_run`) this profile's run.
    """
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
        source_file = project / name
        if source_file.is_file() and not _project_run_output(Path(name)):
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_file, workdir / name)
    subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    commit_workspace(workdir, "smoke workspace", source)


def _project_run_output(name: Path) -> bool:
    """dvc.lock and reports/<stage>/...: what the project's own `dvc repro` wrote."""
    return name == Path("dvc.lock") or (name.parts[0] == REPORTS.name and len(name.parts) > 2)


def commit_workspace(workdir: Path, title: str, source: Mapping[str, str]) -> None:
    """Commit everything in the workspace, naming the project's commit in git trailers.

    `gptlab report` reads them (gptlab.reproduction): the throwaway repository's own
    commit says nothing about which code ran.
    """
    trailers = [f"Source-Commit: {source[SOURCE_COMMIT_ENV]}"] if SOURCE_COMMIT_ENV in source else []
    if SOURCE_DIRTY_ENV in source:
        trailers.append(f"Source-Dirty: {source[SOURCE_DIRTY_ENV]}")
    message = title + ("\n\n" + "\n".join(trailers) if trailers else "")
    git = ["git", "-c", "user.name=gptlab", "-c", "user.email=gptlab@localhost"]
    subprocess.run([*git, "add", "-A"], cwd=workdir, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", message], cwd=workdir, check=True)


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
    return {SOURCE_COMMIT_ENV: commit, SOURCE_DIRTY_ENV: str(bool(status.strip())).lower()}


def run_profile(project: Path, profile: Path, workdir: Path) -> Path:
    """Run every stage with the profile's overrides; returns the workspace's reports folder."""
    overrides = load_overrides(profile, project / "params.yaml")
    source = source_commit_env(project)
    prepare_workspace(project, workdir, source)
    # Runs land in the project's own MLflow store (not the throwaway workspace) unless told otherwise,
    # tagged with the project's own commit, not the workspace's.
    env = experiment_env(project)
    env.update(source)
    dvc = ["dvc"] if os.environ.get(VERBOSE_ENV) else [sys.executable, "-m", "gptlab.dvc_quiet"]
    result = subprocess.run(
        [*dvc, "exp", "run", "--name", profile.stem, *set_arguments(overrides)], cwd=workdir, env=env
    )
    if result.returncode:
        raise GptlabError(
            f"the {profile.stem} profile failed in {workdir} (dvc exp run exited {result.returncode})"
        )
    # The run as the workspace's HEAD: `dvc metrics diff`, `dvc plots diff` and `gptlab compare`
    # there then measure further experiments against it.
    commit_workspace(workdir, f"{profile.stem} run", source)
    return workdir / REPORTS
