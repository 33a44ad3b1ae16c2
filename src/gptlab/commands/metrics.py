"""`gptlab metrics check | update-baseline`: guard metrics against a committed baseline."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.metrics_check import DEFAULT_BASELINE, compare, load_baseline, markdown_table, update_baseline
from gptlab.paths import REPORTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["check", "update-baseline"], help="compare, or accept the current values"
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
    if args.action == "update-baseline":
        rows = update_baseline(args.baseline, args.reports)
        print(markdown_table(compare(load_baseline(args.baseline), args.reports)))
        print(f"\n{args.baseline}: {len(rows)} baseline values updated from {args.reports}")
        return 0
    return check(args.baseline, args.reports)


def check(baseline: Path, reports: Path) -> int:
    """Print the comparison table; 1 if any guarded metric regressed or is missing."""
    rows = compare(load_baseline(baseline), reports)
    print(markdown_table(rows))
    failed = [row for row in rows if row.failed]
    if failed:
        names = ", ".join(f"{r.file}:{r.metric} ({r.status})" for r in failed)
        print(f"\nFAILED: {len(failed)} of {len(rows)} metrics regressed or missing: {names}")
        print(f"If the change is intended: gptlab metrics update-baseline --reports {reports}")
        return 1
    print(f"\nOK: {len(rows)} metrics within tolerance of {baseline}")
    return 0
