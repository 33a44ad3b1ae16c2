"""Profiles: YAML files of overrides laid out like params.yaml (profiles/*.yaml).

A profile is checked against the whole params schema before anything runs,
then handed to `dvc exp run` as `-S key=value` arguments, so DVC records
exactly which params each experiment used. `gptlab run` runs one in the
project (its results land in `dvc exp show` beside the default run);
`gptlab smoke` runs the smoke profile in a throwaway copy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from gptlab.environment import PIPELINE_RUN_ENV
from gptlab.errors import InputError
from gptlab.pipeline.params import Params
from gptlab.schema import ConfigError, build, flatten, read_yaml

PROFILES_DIR = Path("profiles")


def profile_path(name_or_path: str | Path) -> Path:
    """A profile file: the path itself, or profiles/<name>.yaml for a bare name such as `fast`."""
    return named_yaml(name_or_path, PROFILES_DIR, "profile", "profiles")


def named_yaml(name_or_path: str | Path, folder: Path, kind: str, plural: str) -> Path:
    """The path itself, or folder/<name>.yaml for a bare name; a missing file names those there are.

    A pipe is a file too (`<(command)`, /dev/stdin, `-` for stdin): it is read once, like any other.
    """
    path = Path("/dev/stdin" if str(name_or_path) == "-" else name_or_path)
    if path.suffix not in (".yaml", ".yml") and path.parent == Path("."):
        path = folder / f"{path}.yaml"
    if path.is_dir():
        raise IsADirectoryError(f"{kind} {path}: is a directory, not a file")
    if not path.exists():
        known = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        raise InputError(f"{kind} {path} not found ({plural} here: {', '.join(known) or 'none'})")
    return path


def load_overrides(profile: Path, params_file: Path) -> dict[str, Any]:
    """The profile's overrides as {dotted.key: value}, checked against the full params schema."""
    return flatten(_checked_overrides(profile, params_file)[0])


def profile_params(profile: Path, params_file: Path) -> Params:
    """The params a run of the profile reads: params.yaml with the profile's overrides applied."""
    return _checked_overrides(profile, params_file)[1]


def _checked_overrides(profile: Path, params_file: Path) -> tuple[dict[str, Any], Params]:
    overrides = read_yaml(profile) or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{profile}: expected a mapping of overrides laid out like params.yaml")
    params = read_yaml(params_file)
    try:
        return overrides, build(Params, merge_overrides(params, overrides), "")
    except ConfigError as exc:
        raise ConfigError(f"{profile}: {exc}") from None


def set_arguments(overrides: dict[str, Any]) -> list[str]:
    """`dvc exp run` arguments that apply the overrides (values as JSON, which YAML reads back)."""
    return [arg for key, value in overrides.items() for arg in ("-S", f"{key}={json.dumps(value)}")]


def dvc_executable() -> str:
    """This interpreter's dvc (the one installed with gptlab), else the first on PATH."""
    local = Path(sys.executable).with_name("dvc")
    return str(local) if local.is_file() else (shutil.which("dvc") or "dvc")


def experiment_env(project: Path, name: str | None = None) -> dict[str, str]:
    """The environment for `dvc exp run`: runs land in the project's MLflow store unless told otherwise.

    With `name` (the DVC experiment's), every stage run of it shares the tag gptlab.pipeline_run,
    `<name>-<random>`, which no other run of the same name has.
    """
    env = dict(os.environ)
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{project.resolve() / 'mlflow.db'}")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    if name is not None:
        env.setdefault(PIPELINE_RUN_ENV, f"{name}-{uuid.uuid4().hex[:8]}")
    return env


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` (nested, like params.yaml) with `overrides` laid over it, section by section (a new dict)."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = merge_overrides(base[key], value)
        else:
            merged[key] = value
    return merged
