"""`dvc exp show`, narrowed to what tells experiments apart: the params that differ and the headline metrics.

DVC's own table has a column for every param, every metric and every dependency's hash, and
each stage here lists every module it imports, so it runs to hundreds of columns. This reads
`dvc exp show --json` and keeps, per row (the commit and each of its experiments), the name,
short rev and creation time, the params whose values differ between the rows, and the metrics
the metrics baseline guards (baselines/*.yaml): the headline figures, named in one place.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gptlab.errors import GptlabError
from gptlab.experiments.dvc_commands import (
    WORKSPACE,
    ExperimentRow,
    ask_dvc,
    experiments,
    revision_row,
    short_rev,
)
from gptlab.experiments.metrics_check import load_baseline
from gptlab.paths import REPORTS

BASELINES_DIR = Path("baselines")
HEADING = ("experiment", "rev", "created")
MISSING = "-"


@dataclass(frozen=True)
class HeadlineMetric:
    file: str  # project-relative, as DVC names metrics files
    key: str  # dotted key in that file
    title: str  # the column's heading: <stage>/<key>


@dataclass(frozen=True)
class Comparison:
    """The narrowed table: its rows, the params that differ between them, the headline metrics."""

    rows: list[ExperimentRow]
    params: list[str]
    metrics: list[HeadlineMetric]

    @property
    def with_state(self) -> bool:
        return any(row.shown_state for row in self.rows)

    @property
    def columns(self) -> list[str]:
        heading = [*HEADING, "state"] if self.with_state else list(HEADING)
        return heading + self.params + [metric.title for metric in self.metrics]

    def records(self) -> list[dict[str, Any]]:
        """One {column: value} per row, the values as DVC gives them (None where a row has none)."""
        return [dict(zip(self.columns, self._values(row), strict=True)) for row in self.rows]

    def cells(self, precision: int) -> list[list[str]]:
        """The rows as text: params as written, metrics to `precision` significant digits."""
        lead = len(self.columns) - len(self.metrics)
        return [
            [_param_text(v) for v in values[:lead]] + [_metric_text(v, precision) for v in values[lead:]]
            for values in (self._values(row) for row in self.rows)
        ]

    def _values(self, row: ExperimentRow) -> list[Any]:
        heading = [row.name, short_rev(row.rev), row.created] + ([row.shown_state] if self.with_state else [])
        params = [row.params.get(key) for key in self.params]
        return heading + params + [row.metrics.get(m.file, {}).get(m.key) for m in self.metrics]


def exp_show(workdir: Path, dvc: str) -> list[dict[str, Any]]:
    """`dvc exp show --json` run in `workdir`, asked again if it stalls; a failure is one line: what DVC said last."""
    if not workdir.is_dir():
        raise GptlabError(f"{workdir}: no such folder")
    try:
        proc = ask_dvc(dvc, ["exp", "show", "--json"], cwd=workdir)
    except FileNotFoundError as exc:
        raise GptlabError(f"{dvc} not found: install DVC (`pip install dvc`) or put it on PATH") from exc
    if proc.code:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        said = said.removeprefix("ERROR: ")
        if "not inside of a DVC repository" in said:
            raise GptlabError(
                f"{workdir} is not in a DVC project (no .dvc folder there or above): run "
                "`gptlab compare` in the project, or name it with --workdir"
            )
        raise GptlabError(f"`dvc exp show` failed in {workdir} (exit {proc.code}): {said}")
    try:
        shown = json.loads(proc.stdout or "[]")
    except json.JSONDecodeError as exc:
        raise GptlabError(f"`dvc exp show --json` in {workdir} printed no JSON ({exc})") from exc
    if not isinstance(shown, list):
        raise GptlabError(f"`dvc exp show --json` in {workdir}: expected a list of revisions")
    if not shown:
        raise GptlabError(f"{workdir} has no git commit yet: DVC experiments start from one; commit first")
    return shown


def experiment_rows(shown: Sequence[dict[str, Any]]) -> list[ExperimentRow]:
    """Each commit of `dvc exp show --json`, then its experiments in DVC's order (newest first).

    The workspace comes first, and only when it holds params or metrics that no commit or
    experiment does: after `dvc exp run` it holds the last experiment's, a row already shown.
    """
    workspace, rows = None, []
    for entry in shown:
        if entry.get("rev") == WORKSPACE:
            workspace = revision_row(entry, WORKSPACE, "")
            continue
        rows += [revision_row(entry, entry.get("name"), ""), *experiments(entry)]
    if workspace and all((workspace.params, workspace.metrics) != (r.params, r.metrics) for r in rows):
        rows.insert(0, workspace)
    return rows


def changed_params(rows: Sequence[ExperimentRow]) -> list[str]:
    """The params whose values (or presence) differ between the rows, in the order DVC lists them."""
    keys = list(dict.fromkeys(key for row in rows for key in row.params))
    return [key for key in keys if len({json.dumps(row.params.get(key), sort_keys=True) for row in rows}) > 1]


def baseline_files(workdir: Path) -> list[Path]:
    """The project's metrics baselines, baselines/*.yaml; none is an error naming the folder."""
    found = sorted((workdir / BASELINES_DIR).glob("*.yaml"))
    if not found:
        raise GptlabError(
            f"no metrics baseline in {workdir / BASELINES_DIR}: the headline metrics are the ones a "
            "baseline guards; name one with --baseline"
        )
    return found


def headline_metrics(baselines: Sequence[Path]) -> list[HeadlineMetric]:
    """The metrics the baselines guard, each once, in the baselines' order."""
    seen: dict[tuple[str, str], HeadlineMetric] = {}
    for path in baselines:
        for file, guards in load_baseline(path).items():
            dvc_file = (REPORTS / file).as_posix()  # baselines name files relative to reports/
            for key in guards:
                seen.setdefault((dvc_file, key), HeadlineMetric(dvc_file, key, _metric_title(file, key)))
    return list(seen.values())


def _metric_title(file: str, key: str) -> str:
    """<stage>/<key> for reports/<stage>/metrics.json, <file without .json>/<key> for any other file."""
    path = PurePosixPath(file)
    where = path.parent if path.name == "metrics.json" else path.with_suffix("")
    return key if str(where) == "." else f"{where}/{key}"


def headline_lines(project: Path, name: str, dvc: str) -> list[str]:
    """Experiment `name`'s headline metrics (those the baselines guard), one line per stage.

    `  pretrain             final_val_loss 6.701, initial_val_loss 11`; a DVC that cannot show
    them is one line saying so, as the run itself is done.
    """
    try:
        rows = [row for row in experiment_rows(exp_show(project, dvc)) if row.name == name]
        metrics = headline_metrics(baseline_files(project))
    except GptlabError as exc:
        return [f"  (no headline metrics: {exc})"]
    by_stage: dict[str, list[str]] = {}
    for metric in metrics:
        value = rows[0].metrics.get(metric.file, {}).get(metric.key) if rows else None
        if value is not None:
            stage, key = metric.title.split("/", 1) if "/" in metric.title else ("", metric.title)
            by_stage.setdefault(stage, []).append(f"{key} {_metric_text(value, 4)}")
    return [f"  {stage:<20} {', '.join(figures)}" for stage, figures in by_stage.items()]


def compare(shown: Sequence[dict[str, Any]], metrics: list[HeadlineMetric]) -> Comparison:
    """The rows of `dvc exp show --json`'s output, with the params that differ and `metrics`."""
    rows = experiment_rows(shown)
    return Comparison(rows, changed_params(rows), metrics)


def text_table(comparison: Comparison, precision: int, width: int) -> str:
    """Aligned for a terminal `width` characters wide: one line per row when that fits, else
    one line per column (experiments side by side), wrapped into blocks as pandas does."""
    # pandas on first use: keeps `gptlab --help` fast
    import pandas as pd

    frame = pd.DataFrame(comparison.cells(precision), columns=comparison.columns)
    wide = frame.to_string(index=False)
    if max(len(line) for line in wide.splitlines()) <= width:
        return wide
    tall = frame.set_index(HEADING[0]).T
    tall.columns.name = None
    return tall.to_string(line_width=width)


def markdown_table(comparison: Comparison, precision: int) -> str:
    """A GitHub Markdown table, one line per row (for CI summaries)."""
    return markdown_grid(comparison.columns, comparison.cells(precision))


def markdown_grid(heading: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """GitHub Markdown table lines: the heading, its rule, then each row; a `|` in a cell escaped."""
    lines = [_markdown_line(heading), "|" + "---|" * len(heading)]
    return "\n".join(lines + [_markdown_line(cells) for cells in rows])


def _markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _param_text(value: Any) -> str:
    if value is None:
        return MISSING
    return value if isinstance(value, str) else json.dumps(value)


def _metric_text(value: Any, precision: int) -> str:
    if isinstance(value, float):
        return f"{value:.{precision}g}"
    return _param_text(value)
