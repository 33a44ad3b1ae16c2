"""`gptlab report`: the book's printed figures beside a run's.

By default it writes .gptlab/REPRODUCTION.md (ignored by git) and logs nothing: looking
at a run changes no tracked file and creates no MLflow experiment. `--write` updates the
committed reports/REPRODUCTION.md (the reference run's, or <reports>/REPRODUCTION.md),
`--out -` prints it, and `--log` also logs it as a `report` run in MLflow.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gptlab.book.reproduction import (  # light: torch only when needed
    BOOK_FILE,
    NOT_RUN,
    OFF,
    OK,
    REPORT_NAME,
    Figure,
    make_report,
    save_report,
    tally,
)
from gptlab.files import require_folder
from gptlab.paths import REPORTS
from gptlab.pipeline.params import load_params
from gptlab.schema import read_yaml

# What a missing --reports folder is told: the folders a run writes.
REPORTS_HINT = " (a run's reports: reports after `dvc repro`, .gptlab/smoke/reports after `gptlab smoke`)"
# Where the report goes unless told otherwise: beside the smoke workspace, never tracked.
DEFAULT_OUT = Path(".gptlab") / REPORT_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reports",
        type=Path,
        default=REPORTS,
        help="folder holding the run's <stage>/ reports (default: %(default)s; "
        "the smoke profile writes .gptlab/smoke/reports)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where to write the report, '-' for stdout (default: {DEFAULT_OUT}, which git ignores)",
    )
    where.add_argument(
        "--write",
        action="store_true",
        help="update <reports>/REPRODUCTION.md, the file committed beside the reference run's reports",
    )
    parser.add_argument(
        "--book", type=Path, default=BOOK_FILE, help="the book's figures (default: %(default)s)"
    )
    parser.add_argument(
        "--log",
        action="store_true",
        help="also log the report as a `report` run in MLflow, in the experiment of the run reported on",
    )


def _experiment_of(reports: Path) -> str:
    """The experiment of the run reported on: as the params.yaml beside its reports names it (a
    smoke workspace's holds the profile's), else the project's."""
    beside = reports.resolve().parent / "params.yaml"
    if beside.is_file():
        named = (read_yaml(beside) or {}).get("tracking", {}).get("experiment")
        if isinstance(named, str) and named:
            return named
    return load_params().tracking.experiment


class _Progress:
    """One line per chapter on a terminal's stderr: the live figures compute for up to a minute."""

    def __init__(self) -> None:
        self.chapter: int | str | None = None
        self.start = time.monotonic()

    def __call__(self, figure: Figure) -> None:
        if figure.chapter != self.chapter:
            self.chapter = figure.chapter
            name = (
                f"appendix {figure.chapter}"
                if isinstance(figure.chapter, str)
                else f"chapter {figure.chapter}"
            )
            print(
                f"gptlab report: {name} ({time.monotonic() - self.start:.0f} s)", file=sys.stderr, flush=True
            )


def run(args: argparse.Namespace) -> int:
    require_folder(args.reports, "--reports", REPORTS_HINT)
    out = args.reports / REPORT_NAME if args.write else args.out or DEFAULT_OUT
    text, outcomes = make_report(
        args.book, args.reports, progress=_Progress() if sys.stderr.isatty() else None
    )
    to_stdout = str(out) == "-"
    if to_stdout:
        sys.stdout.write(text)
    else:
        save_report(text, out)
    counts = {status: sum(o.status == status for o in outcomes) for status in (OK, OFF, NOT_RUN)}
    if args.log:
        # the MLflow side on first use: keeps `gptlab --help` fast
        from gptlab.tracking.runs import stage_run

        with stage_run("report", _experiment_of(args.reports), {"reports": str(args.reports)}) as tracker:
            tracker.set_tags({"gptlab.figures_ok": counts[OK], "gptlab.figures_off": counts[OFF]})
            tracker.log_text(text, REPORT_NAME)
    summary = (
        f"{'the report' if to_stdout else out}: {tally(outcomes)} "
        f"of {len(outcomes)} figures from the book; each ✗ and not-run row says why"
    )
    print(summary, file=sys.stderr if to_stdout else sys.stdout)
    return 0
