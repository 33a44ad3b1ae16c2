"""`gptlab compare`: the experiments of `dvc exp show`, one row each, in a few dozen columns.

Each row (the commit, each of its experiments) shows its name, short rev and creation time,
the params that differ between the rows and the metrics the metrics baseline guards
(baselines/*.yaml); never the dependencies' hashes that fill DVC's own table.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from gptlab.errors import InputError
from gptlab.experiments.compare import (
    baseline_files,
    compare,
    exp_show,
    headline_metrics,
    markdown_table,
    text_table,
)
from gptlab.experiments.profiles import dvc_executable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir",
        "-C",
        type=Path,
        default=Path("."),
        help="the DVC project to compare the experiments of (default: the current folder)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        help="metrics baseline naming the headline metrics; repeat for more "
        "(default: every baselines/*.yaml of the project)",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--md", action="store_true", help="print a Markdown table (e.g. for a CI summary)")
    output.add_argument("--json", action="store_true", help="print the rows as JSON, values unrounded")
    parser.add_argument(
        "--precision", type=int, default=5, help="significant digits of the metrics (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    if args.precision < 1:
        raise InputError(f"--precision: expected 1 or more, got {args.precision}")
    shown = exp_show(args.workdir, dvc_executable())
    metrics = headline_metrics(args.baseline or baseline_files(args.workdir))
    comparison = compare(shown, metrics)
    if args.json:
        print(json.dumps(comparison.records(), indent=2))
    elif args.md:
        print(markdown_table(comparison, args.precision))
    else:
        print(text_table(comparison, args.precision, shutil.get_terminal_size().columns))
    return 0
