"""Every figure the book prints for chapters 2-4 and chapter 5's demos, computed live by our code.

One comparison over the committed reference run per test session: each chapter's rows must be ✓.
A copy of the data file with every live figure's book value nudged must turn each of them ✗, so no
row passes whatever our code computes.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gptlab.book.reproduction import OFF, OK, Outcome, RunInfo, compare, load_book, render_markdown

from helpers import PROJECT_ROOT

BOOK = PROJECT_ROOT / "reproduction" / "book.yaml"
REPORTS = PROJECT_ROOT / "reports"
CHAPTERS = (2, 3, 4)


@pytest.fixture(scope="module")
def run(shared_data: Path) -> RunInfo:
    """The committed reference run, its inputs read from the test inputs folder."""
    reference = RunInfo.of_reports(REPORTS)
    return RunInfo(
        REPORTS,
        reference.root,
        {**reference.params, "data.raw_dir": str(shared_data)},
        "dvc.lock",
        None,
        None,
    )


@pytest.fixture(scope="module")
def outcomes(run: RunInfo) -> dict[str, Outcome]:
    return {o.figure.id: o for o in compare(load_book(BOOK), REPORTS, run)}


def _rows(outcomes: dict[str, Outcome], chapter: int) -> list[Outcome]:
    return [o for o in outcomes.values() if o.figure.chapter == chapter]


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_row_of_the_chapter_is_reproduced(outcomes: dict[str, Outcome], chapter: int) -> None:
    rows = _rows(outcomes, chapter)
    assert len(rows) >= 25, f"chapter {chapter} has only {len(rows)} figures"
    off = {o.figure.id: (o.status, o.reason, o.ours) for o in rows if o.status != OK}
    assert not off


@pytest.mark.slow
def test_chapter_5_demos_are_reproduced(outcomes: dict[str, Outcome]) -> None:
    demos = [o for o in _rows(outcomes, 5) if o.figure.ours is not None and o.figure.ours.live]
    assert len(demos) >= 13
    assert all(o.status == OK for o in demos), [(o.figure.id, o.ours) for o in demos if o.status != OK]


def _nudged(value: Any) -> Any:
    """A value close to the book's but wrong: its first number moved by 1, or its first text changed."""
    if isinstance(value, list):
        return [_nudged(value[0]), *value[1:]]
    if isinstance(value, str) and value.startswith("["):  # a printout: nudged, written back the same way
        return _printed(_nudged(ast.literal_eval(value)))
    if isinstance(value, str):
        plain = value.replace(",", "")
        try:
            return (float(plain) if "." in plain else int(plain)) + 1
        except ValueError:
            return value + "!"
    return value + 1


def _printed(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_printed(item) for item in value) + "]"
    return "..." if value is Ellipsis else repr(value)


def nudge_book(path: Path, chapters: tuple[int, ...]) -> set[str]:
    """Write a copy of the data file with the book value of every live figure of `chapters` nudged."""
    data = yaml.safe_load(BOOK.read_text(encoding="utf-8"))
    nudged = copy.deepcopy(data)
    ids = set()
    for figure in nudged["figures"]:
        if figure["chapter"] in chapters and "live" in (figure.get("ours") or {}):
            figure["book"] = _nudged(figure["book"])
            ids.add(figure["id"])
    path.write_text(yaml.safe_dump(nudged, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return ids


@pytest.mark.slow
def test_a_wrong_book_value_turns_its_row_off(
    tmp_path: Path, run: RunInfo, outcomes: dict[str, Outcome]
) -> None:
    ids = nudge_book(tmp_path / "book.yaml", (*CHAPTERS, 5))
    assert len(ids) >= 90
    nudged = {o.figure.id: o for o in compare(load_book(tmp_path / "book.yaml"), REPORTS, run)}
    still_on = sorted(i for i in ids if nudged[i].status != OFF)
    assert not still_on
    untouched = [i for i in outcomes if i not in ids and outcomes[i].status == OK]
    assert all(nudged[i].status == OK for i in untouched)


@pytest.mark.slow
def test_the_report_shows_a_row_per_figure_with_ours_beside_the_books(run: RunInfo) -> None:
    text = render_markdown(BOOK, REPORTS)
    assert "## Chapter 3: Coding attention mechanisms" in text
    (row,) = [line for line in text.splitlines() if "`ch3-journey-context`" in line]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "[0.4419, 0.6515, 0.5683]"  # as printed
    assert re.fullmatch(r"\[0\.441\d\d, 0\.651\d\d, 0\.568\d\d\]", cells[3])  # ours, one digit more
    assert cells[5] == OK


@pytest.fixture
def committed_report() -> Iterator[str]:
    yield (REPORTS / "REPRODUCTION.md").read_text(encoding="utf-8")


def test_the_committed_report_names_its_commit_params_and_base_models(committed_report: str) -> None:
    header = committed_report.split("\n**", 1)[0]
    commit = next(line for line in header.splitlines() if line.startswith("- commit:"))
    assert "uncommitted" not in commit and "unknown" not in commit
    assert "as recorded in dvc.lock" in header
    assert (
        "- base models: load-gpt2 has not run (no load-gpt2 stage in dvc.lock; params.yaml asks for "
        in header
    )
