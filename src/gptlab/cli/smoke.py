"""`gptlab smoke`: run all seven stages on a small profile, then check its metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.experiments.metrics_check import DEFAULT_BASELINE, check
from gptlab.experiments.smoke import DEFAULT_PROFILE, run_profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        type=Path,
        default=DEFAULT_PROFILE,
        help="overrides of params.yaml (default: %(default)s)",
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
    workdir = args.workdir or project / ".gptlab" / args.profile.stem
    reports = run_profile(project, args.profile, workdir, fresh=args.fresh)
    print(f"\nSmoke run finished: outputs in {workdir}, metrics in {reports}")
    if args.no_check:
        return 0
    return check(args.baseline, reports)
