"""`gptlab report`: the book's printed figures beside this run's, written to reports/REPRODUCTION.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.book.reproduction import (  # light: torch only when needed
    BOOK_FILE,
    NOT_RUN,
    OFF,
    OK,
    write_report,
)
from gptlab.paths import REPORTS
from gptlab.pipeline.params import load_params
from gptlab.schema import read_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reports",
        type=Path,
        default=REPORTS,
        help="folder holding the run's <stage>/ reports (default: %(default)s; "
        "the smoke profile writes .gptlab/smoke/reports)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the report (default: <reports>/REPRODUCTION.md)",
    )
    parser.add_argument(
        "--book", type=Path, default=BOOK_FILE, help="the book's figures (default: %(default)s)"
    )
    parser.add_argument(
        "--no-mlflow",
        action="store_true",
        help="only write the file; by default it is also logged as a `report` run in the MLflow "
        "experiment of params.yaml (tracking.experiment)",
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


def run(args: argparse.Namespace) -> int:
    out, outcomes = write_report(args.out, book_path=args.book, reports_dir=args.reports)
    counts = {status: sum(o.status == status for o in outcomes) for status in (OK, OFF, NOT_RUN)}
    if not args.no_mlflow:
        # the MLflow side on first use: keeps `gptlab --help` fast
        from gptlab.tracking.runs import stage_run

        with stage_run("report", _experiment_of(args.reports), {"reports": str(args.reports)}) as tracker:
            tracker.set_tags({"gptlab.figures_ok": counts[OK], "gptlab.figures_off": counts[OFF]})
            tracker.log_text(out.read_text(encoding="utf-8"), "REPRODUCTION.md")
    print(
        f"{out}: {counts[OK]} ✓, {counts[OFF]} ✗, {counts[NOT_RUN]} not run of {len(outcomes)} "
        "figures from the book"
    )
    return 0
