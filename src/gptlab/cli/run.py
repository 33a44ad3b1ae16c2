"""`gptlab run --profile NAME [STAGE ...]`: the pipeline as a DVC experiment with a profile's overrides.

The profile (profiles/NAME.yaml, or a path) is checked against the params
schema, then `dvc exp run --temp -S ...` runs it in a temporary copy of the
project: your workspace, params.yaml and dvc.lock stay as they are, and the
experiment shows in `dvc exp show` (and its runs in the MLflow UI) beside the
default run. Stages whose inputs did not change are taken from DVC's cache.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from gptlab.errors import GptlabError, InputError
from gptlab.experiments.profiles import experiment_env, load_overrides, profile_path, set_arguments
from gptlab.schema import name_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        required=True,
        metavar="NAME",
        help="profiles/NAME.yaml, or a path to a profile file (a pipe too; '-' for stdin)",
    )
    parser.add_argument(
        "stages", nargs="*", metavar="STAGE", help="run only up to these stages (default: the whole DAG)"
    )
    parser.add_argument(
        "--name", help="the experiment's name in `dvc exp show` (default: <profile>-<date>-<time>)"
    )


def run(args: argparse.Namespace) -> int:
    project = Path.cwd()
    if not (project / "dvc.yaml").is_file():
        raise GptlabError("dvc.yaml not found: run `gptlab run` from the project root")
    if args.name is not None and (problem := name_problem(args.name)):
        raise InputError(f"--name: {problem}")
    profile = profile_path(args.profile)
    overrides = load_overrides(profile, project / "params.yaml")
    stem = profile.stem if profile.is_file() else "profile"  # a pipe's name (/dev/fd/63) says nothing
    name = args.name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = ["dvc", "exp", "run", "--temp", "--name", name, *set_arguments(overrides), *args.stages]
    print(f"experiment {name}: {' '.join(command[5:]) or 'no overrides'}", flush=True)
    result = subprocess.run(command, env=experiment_env(project, name))
    if result.returncode:
        raise GptlabError(f"experiment {name} failed (dvc exp run exited {result.returncode})")
    print(f"\nexperiment {name} done: compare it with `gptlab compare` (or `dvc exp show`, `dvc exp diff`)")
    return 0
