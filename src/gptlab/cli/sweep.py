"""`gptlab sweep NAME`: a sweep file's variants as queued DVC experiments, then their table.

This module only parses the arguments and calls gptlab.experiments.sweep.run, which checks the sweep
file, queues its variants, waits for them and writes reports/sweeps/<sweep>.md and .csv (one sweep
at a time, every wait bounded; docs/sweeps.md says what a stop leaves).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.errors import InputError
from gptlab.experiments import sweep as sweeps

HELP = {
    "sweep": "sweeps/NAME.yaml, or a path to a sweep file (a pipe too, with --name; '-' for stdin)",
    "--profile": "profiles/PROFILE.yaml (or a path, a pipe too): overrides under every variant, e.g. smoke",
    "--jobs": "experiments run at a time (dvc queue start --jobs)",
    "--name": "the sweep's name: prefix of its experiments, its MLflow tag and table file (default: the file's name, plus -PROFILE with --profile)",
    "--replace": "remove earlier experiments of the same names first (default: refuse to run over them)",
    "--collect": "queue and run nothing: write the table from the sweep's experiments as they are",
    "--timeout": "stop waiting for the queue after this many seconds (default: %(default)g, a day); the experiments go on, --collect writes the table later",
    "--out": "folder for <sweep>.md and .csv (default: reports/sweeps)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("sweep", metavar="NAME", help=HELP["sweep"])
    add("--profile", help=HELP["--profile"])
    add("--jobs", "-j", type=int, default=1, help=HELP["--jobs"])
    add("--name", help=HELP["--name"])
    add("--replace", action="store_true", help=HELP["--replace"])
    add("--collect", action="store_true", help=HELP["--collect"])
    add("--timeout", type=float, default=sweeps.QUEUE_TIMEOUT_S, help=HELP["--timeout"])
    add("--out", type=Path, help=HELP["--out"])


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise InputError(f"--jobs: expected 1 or more, got {args.jobs}")
    if not args.timeout > 0:
        raise InputError(f"--timeout: expected a positive number of seconds, got {args.timeout:g}")
    options = dict(jobs=args.jobs, replace=args.replace, collect_only=args.collect, timeout=args.timeout)
    return sweeps.run(args.sweep, args.profile, args.name, out=args.out, **options)
