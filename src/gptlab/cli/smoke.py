"""`gptlab smoke`: run all eight stages on a small profile, then check its metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.experiments.metrics_check import DEFAULT_BASELINE, check
from gptlab.experiments.profiles import profile_params, profile_path
from gptlab.experiments.smoke import DEFAULT_PROFILE, next_steps, run_profile, smoke_log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE.stem,
        metavar="NAME",
        help="profiles/NAME.yaml, or a path to a profile file, as for `gptlab run` (default: %(default)s)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="workspace to run in (default: .gptlab/<profile name>)"
    )
    parser.add_argument(
        "--baseline", type=Path, default=DEFAULT_BASELINE, help="metrics baseline (default: %(default)s)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="replace the workspace even if it holds work made after its last smoke run "
        "(DVC experiments, a tracking store, edited files)",
    )
    parser.add_argument("--no-check", action="store_true", help="run only; skip the metrics check")


def run(args: argparse.Namespace) -> int:
    project = Path.cwd()
    if not (project / "dvc.yaml").is_file():
        raise FileNotFoundError("dvc.yaml not found: run `gptlab smoke` from the project root")
    profile = profile_path(args.profile)
    if not args.no_check and not args.baseline.is_file():
        raise FileNotFoundError(f"--baseline {args.baseline}: no such file (or pass --no-check)")
    workdir = args.workdir or project / ".gptlab" / profile.stem
    reports = run_profile(project, profile, workdir, fresh=args.fresh, workdir_given=args.workdir is not None)
    shown = workdir.relative_to(project) if workdir.is_relative_to(project) else workdir
    print(f"\nSmoke run finished in {shown}; every stage's output is in {smoke_log(shown)}\n")
    result = 0 if args.no_check else check(args.baseline, reports)
    experiment = profile_params(profile, project / "params.yaml").tracking.experiment
    print("", *next_steps(shown, experiment), sep="\n")
    return result
