"""`gptlab metrics check | update-baseline`: guard metrics against a committed baseline.

Each baseline under baselines/ names the reports folder whose values it holds: smoke.yaml
the smoke profile's (.gptlab/smoke/reports), reference.yaml the committed reference run's
(reports). `check` with no arguments compares every such pair whose reports exist; it exits 0
when every guarded metric is within tolerance, 1 when one regressed or is missing, and 2 when
it could not check. `update-baseline` accepts the current values of the baseline's own
reports, or creates a baseline when it does not exist.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.cli.report import REPORTS_HINT
from gptlab.errors import InputError
from gptlab.experiments.metrics_check import (
    BASELINES,
    DEFAULT_BASELINE,
    check,
    compare,
    create_baseline,
    guarded_reports,
    load_baseline,
    markdown_table,
    pairs_to_check,
    update_baseline,
)
from gptlab.files import require_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=["check", "update-baseline"],
        help="compare (exit 1: a metric regressed or is missing; 2: could not check), or accept the "
        "current values (creating the baseline if it does not exist)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help=f"baseline file (check: default every {BASELINES}/*.yaml whose reports exist, or the one "
        f"guarding --reports; update-baseline: default {DEFAULT_BASELINE})",
    )
    parser.add_argument(
        "--reports",
        type=Path,
        default=None,
        help="folder holding the run's <stage>/metrics.json files (default: the one the baseline names)",
    )


def run(args: argparse.Namespace) -> int:
    """0: within tolerance (or baseline written); 1: a metric regressed or is missing; 2: could not check."""
    if args.reports is not None:
        require_folder(args.reports, "--reports", REPORTS_HINT)
    if args.action == "check":
        pairs = pairs_to_check(args.baseline, args.reports)
        results = []
        for baseline, reports in pairs:
            if len(pairs) > 1:
                print(f"\n## {reports} against {baseline}\n")
            results.append(check(baseline, reports))
        return max(results)
    baseline = args.baseline or DEFAULT_BASELINE
    if baseline.exists():
        reports = args.reports or guarded_reports(baseline)
        if reports is None:
            raise InputError(f"{baseline} names no reports folder (`reports:`): pass --reports")
        updated = update_baseline(baseline, reports)
        rows = compare(load_baseline(baseline), reports)
        done = f"{baseline}: {len(updated)} baseline values updated from {reports}"
    else:
        if args.reports is None:
            raise InputError(
                f"{baseline} does not exist yet: pass --reports, the run whose values it will hold"
            )
        rows = create_baseline(baseline, args.reports)
        done = f"created {baseline}: {len(rows)} metrics from {args.reports}; edit the tolerances freely"
    print(markdown_table(rows))
    print(f"\n{done}")
    return 0
