"""`gptlab run --profile NAME [STAGE ...]`: the pipeline as a DVC experiment with a profile's overrides.

The profile (profiles/NAME.yaml, or a path) is checked against the params
schema, then `dvc exp run --temp -S ...` runs it in a temporary copy of the
project: your workspace, params.yaml and dvc.lock stay as they are, and the
experiment shows in `dvc exp show` (and its runs in the MLflow UI) beside the
default run. Stages whose inputs did not change are taken from DVC's cache.

As `gptlab smoke`, it prints one line per stage as it starts, then the headline
metrics and what to do next; each stage's own output goes to `.gptlab/logs/<name>.log`
(`gptlab -v run` prints it all, DVC's warnings included).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gptlab.environment import VERBOSE_ENV
from gptlab.errors import GptlabError, InputError
from gptlab.experiments.compare import headline_lines
from gptlab.experiments.profiles import (
    dvc_executable,
    experiment_env,
    load_overrides,
    profile_path,
    set_arguments,
)
from gptlab.experiments.smoke import command_lines, dvc_command, run_logged
from gptlab.pipeline.params import load_params
from gptlab.schema import name_problem

# The logs of `gptlab run`, one per experiment (git ignores .gptlab/): apart from the smoke workspaces there.
LOG_DIR = Path(".gptlab") / "logs"


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
    log = LOG_DIR / f"{name}.log"
    (project / LOG_DIR).mkdir(parents=True, exist_ok=True)
    print(
        f"experiment {name}: {len(overrides)} params set by {profile}; every stage's output in {log}",
        flush=True,
    )
    command = [
        *dvc_command(),
        "exp",
        "run",
        "--temp",
        "--name",
        name,
        *set_arguments(overrides),
        *args.stages,
    ]
    env = experiment_env(project, name)
    if run_logged(command, project, env, project / log, verbose=bool(env.get(VERBOSE_ENV))):
        raise GptlabError(f"experiment {name} failed; every stage's output is in {log}")
    # From the overrides: a profile read from a pipe cannot be read twice.
    experiment = (
        overrides.get("tracking.experiment") or load_params(project / "params.yaml").tracking.experiment
    )
    print(
        f"\nexperiment {name} done. Headline metrics:",
        *headline_lines(project, name, dvc_executable()),
        sep="\n",
    )
    steps = [
        (f"gptlab ui --experiment {experiment}", "its MLflow runs: curves, samples, models"),
        ("gptlab compare", "it beside the other DVC experiments"),
        (f"dvc exp apply {name}", "its params and outputs into the workspace"),
    ]
    print("", *command_lines(steps), sep="\n")
    return 0
