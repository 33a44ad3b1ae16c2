"""`gptlab metrics check | update-baseline`: guard metrics against a committed baseline.

`check` exits 0 when every guarded metric is within tolerance, 1 when one regressed or is
missing, and 2 when it could not check (a missing or malformed baseline, no reports folder).
`update-baseline` accepts the current values, or creates the baseline when it does not exist.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.metrics_check import (
    DEFAULT_BASELINE,
    check,
    compare,
    create_baseline,
    load_baseline,
    markdown_table,
    update_baseline,
)
from gptlab.paths import REPORTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=["check", "update-baseline"],
        help="compare (exit 1: a metric regressed or is missing; 2: could not check), or accept the "
        "current values (creating the baseline if it does not exist)",
    )
    parser.add_argument(
        "--baseline", type=Path, default=DEFAULT_BASELINE, help="baseline file (default: %(default)s)"
    )
    parser.add_argument(
        "--reports",
        type=Path,
        default=REPORTS,
        help="folder holding the run's <stage>/metrics.json files (default: %(default)s; "
        "the smoke profile writes .gptlab/smoke/reports)",
    )


def run(args: argparse.Namespace) -> int:
    """0: within tolerance (or baseline written); 1: a metric regressed or is missing; 2: could not check."""
    if args.action == "check":
        return check(args.baseline, args.reports)
    if args.baseline.exists():
        updated = update_baseline(args.baseline, args.reports)
        rows = compare(load_baseline(args.baseline), args.reports)
        done = f"{args.baseline}: {len(updated)} baseline values updated from {args.reports}"
    else:
        rows = create_baseline(args.baseline, args.reports)
        done = f"created {args.baseline}: {len(rows)} metrics from {args.reports}; edit the tolerances freely"
    print(markdown_table(rows))
    print(f"\n{done}")
    return 0
