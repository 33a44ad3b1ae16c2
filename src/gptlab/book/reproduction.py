"""The book's printed figures beside ours: the reproduction report, reports/REPRODUCTION.md.

The figures live in data, reproduction/book.yaml: each names where the book
prints it, the book's value, a tolerance with its reason, and where our value
comes from: a key of a stage's JSON report, a row of one of its CSV curves, or
a figure computed live from our code (parameter counts, LoRA's trainable
count, the untrained model's greedy tokens, The Verdict's token count). The
report marks each figure ✓ (within tolerance), ✗ (outside it) or "not run" with
the reason: the stage has not run, it does not report that value, or the figure
needs OpenAI's weights and the run used `gpt2.source: pretrain`. A row of a
sweep's table (reports/sweeps/<sweep>.csv, `gptlab sweep`) carries its own
`gpt2.source`, which is what such a figure is checked against. A figure whose
report rests on data other than the book's (the run's params name a corpus,
instructions, pairs or labels of the user's own) is marked "other data", not
compared. Chapters are numbered; appendices are lettered ("E").

The data file is built into frozen dataclasses by gptlab.schema, as params.yaml
is: an unknown, missing or mistyped key is refused naming the file, the figure
and the key.

`render_markdown()` returns the report's text (for MLflow); `write_report()`
also writes it. Only the live chapter 2 and 4 figures import torch, and only
when they are computed.
"""

from __future__ import annotations

import ast
import csv
import functools
import inspect
import json
import math
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gptlab.book.figures import LIVE
from gptlab.book.figures.inputs import NotRun
from gptlab.errors import InputError
from gptlab.files import atomic_path, require_file
from gptlab.paths import REPORTS
from gptlab.schema import ConfigError, FieldError, build, flatten, read_yaml, require

BOOK_FILE = Path("reproduction/book.yaml")
REPORT_NAME = "REPRODUCTION.md"

OK, OFF, NOT_RUN, OTHER_DATA = "✓", "✗", "not run", "other data"

# Data other than the book's, as the run's params tell it: (what, the param naming the file or corpus, the
# values that are the book's, the reports resting on that data: a file prefix, or a counts.json key prefix).
# Their figures are marked "other data", not compared.
_BOOK_DATA = (
    ("a corpus other than The Verdict", "corpus.name", ("verdict",), ("pretrain/", "eval/")),
    ("a pretrain continued from a checkpoint", "pretrain.init", ("random",), ("pretrain/", "eval/")),
    (
        "instructions of your own",
        "tokenize.instruct.path",
        ("data/raw/instruction-data.json",),
        ("instruct/", "preference/", "tokenize/counts.json:instruct."),
    ),
    (
        "preference pairs of your own",
        "tokenize.preference.path",
        ("data/raw/instruction-data-with-preference.json",),
        ("preference/", "tokenize/counts.json:preference."),
    ),
    (
        "labels of your own",
        "tokenize.spam.file",
        ("data/raw/sms_spam_collection/SMSSpamCollection",),
        ("spam/", "sweeps/spam", "tokenize/counts.json:spam."),
    ),
)

# The weights a `needs` row asks for are there only when load-gpt2 took OpenAI's checkpoints.
_OPENAI_SOURCE = "huggingface"

T = TypeVar("T")

# A number, a text, or a printed tensor / list (nested lists of these); a list ending in `...` is a
# printout cut short (only its printed part is compared).
Value = Any


# --------------------------------------------------------------------------- the data file


@dataclass(frozen=True)
class Tolerance:
    """How far our value may lie from the book's: `abs`, or `rel` (a fraction of the book's), and why."""

    reason: str
    abs: float | None = None
    rel: float | None = None

    def __post_init__(self) -> None:
        if (self.abs is None) == (self.rel is None):
            raise ConfigError("expected exactly one of `abs` and `rel`")
        require(self.amount >= 0, self.kind, f"expected a number >= 0, got {self.amount:g}")
        require(bool(self.reason.strip()), "reason", "expected a non-empty string (why that much)")

    @property
    def kind(self) -> str:
        return "abs" if self.abs is not None else "rel"

    @property
    def amount(self) -> float:
        amount = self.abs if self.abs is not None else self.rel
        assert amount is not None, "one of abs and rel, checked when built"
        return amount

    def allows(self, book: Value, ours: Value) -> bool:
        """Numbers within the tolerance, texts and their structure exactly, lists element by element."""
        if isinstance(book, list):
            if not isinstance(ours, list):
                return False
            if book and book[-1] is Ellipsis:  # the printout stops here: compare what it shows
                book, ours = book[:-1], ours[: len(book) - 1]
            return len(book) == len(ours) and all(map(self.allows, book, ours))
        if isinstance(book, str) or isinstance(ours, str | list) or ours is None:
            return book == ours
        if math.isnan(ours):
            return False
        limit = self.amount if self.kind == "abs" else self.amount * abs(book)
        if isinstance(book, float):
            # A hair of slack so that 9.7815 against 9.781 ± 0.0005 is not decided by float representation.
            limit += 1e-9 * max(1.0, abs(book))
        return abs(ours - book) <= limit

    def describe(self, unit: str) -> str:
        if self.amount == 0:
            bound = "exact"
        elif self.kind == "abs":
            # A tolerance on a percentage is in percentage points.
            bound = f"±{self.amount:g}" + (" points" if unit == "%" else f" {unit}" if unit else "")
        else:
            bound = f"±{self.amount * 100:g} % (relative)"
        return f"{bound}: {self.reason.strip()}"


@dataclass(frozen=True)
class Source:
    """Where our value of a figure comes from: a key of a JSON report, a cell of a CSV one, or live."""

    file: str | None = None  # under the reports folder
    key: str | list[str] | None = None  # JSON: a dotted key, or several (summed)
    row: dict[str, Any] = field(default_factory=dict)  # CSV: the row whose columns have these values
    column: str | None = None  # CSV: the cell of that row
    scale: float = 1.0
    live: str | None = None  # a figure computed by our code (gptlab.book.figures.LIVE)
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.live is not None:
            extra = [name for name in ("file", "key", "row", "column") if getattr(self, name)]
            require(not extra, extra[0] if extra else "live", "does not go with `live`")
            function = LIVE.get(self.live)
            if function is None:
                raise FieldError("live", f"unknown figure {self.live!r}; known: {sorted(LIVE)}")
            try:
                inspect.signature(function).bind(None, **self.args)
            except TypeError as exc:
                raise FieldError("args", str(exc)) from None
            return
        require(
            self.file is not None and self.file.endswith((".json", ".csv")),
            "file",
            "expected a .json or .csv path under the reports folder",
        )
        if self.is_csv:
            require(not self.key, "key", "is for .json files; a .csv file takes `row` and `column`")
            require(
                bool(self.row) and self.column is not None,
                "row" if not self.row else "column",
                "a .csv file takes `row` ({column: value}) and `column`",
            )
        else:
            require(
                bool(self.keys) and all(self.keys), "key", "expected a dotted key (or a list of keys, summed)"
            )
            for name in ("row", "column"):
                require(not getattr(self, name), name, "is for .csv files; a .json file takes `key`")

    @property
    def is_csv(self) -> bool:
        return self.file is not None and self.file.endswith(".csv")

    @property
    def keys(self) -> tuple[str, ...]:
        """The JSON keys whose values are summed."""
        return (self.key,) if isinstance(self.key, str) else tuple(self.key or ())

    def describe(self) -> str:
        scale = f" × {self.scale:g}" if self.scale != 1 else ""
        if self.live is not None:
            args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
            return f"computed live: {self.live}({args}){scale}"
        if self.column is not None:
            row = ", ".join(f"{k} {v}" for k, v in self.row.items())
            return f"{self.file} at {row}, column {self.column}{scale}"
        return f"{self.file}: {' + '.join(self.keys)}{scale}"


@dataclass(frozen=True)
class _Entry:
    """A figure as the data file writes it (`book` as written: `load_book` reads its value)."""

    id: str
    chapter: int | str  # a chapter number, or an appendix letter
    description: str
    where: str
    book: Any
    tolerance: Tolerance
    ours: Source | None = None
    needs: str | None = None  # what the run must have used for the figure to count
    unit: str = ""

    def __post_init__(self) -> None:
        for name in ("id", "description", "where"):
            require(bool(getattr(self, name).strip()), name, "expected a non-empty string")
        require(self.needs is None or bool(self.needs.strip()), "needs", "expected a non-empty string")
        if self.ours is None and self.needs is None:
            raise ConfigError("missing key `ours` (where our value comes from) or `needs`")


@dataclass(frozen=True)
class _BookFile:
    """The data file: chapter titles and the figures (each built on its own, so errors name its id)."""

    chapters: dict[int | str, str]
    figures: list[dict[str, Any]]

    def __post_init__(self) -> None:
        require(
            all(isinstance(c, int) or c.isalpha() for c in self.chapters),
            "chapters",
            "expected a mapping of chapter number (or appendix letter) to title",
        )


@dataclass(frozen=True)
class Figure:
    id: str
    chapter: int | str  # a chapter number, or an appendix letter
    description: str
    where: str
    book: Value
    book_text: str  # as printed in the book (what the report shows)
    tolerance: Tolerance
    ours: Source | None
    needs: str | None
    unit: str


@dataclass(frozen=True)
class Book:
    chapters: dict[int | str, str]
    figures: list[Figure]


def load_book(path: Path | str = BOOK_FILE) -> Book:
    """The data file, checked: an unknown, missing or malformed key is a ConfigError naming the figure."""
    path = Path(path)
    require_file(
        path, "a book figures file", f"book figures file {path} not found (the default is {BOOK_FILE})"
    )
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with the keys `chapters` and `figures`")
    book = _built(_BookFile, data, str(path))
    figures: list[Figure] = []
    seen: set[str] = set()
    for index, raw in enumerate(book.figures, start=1):
        name = raw.get("id") if isinstance(raw.get("id"), str) else None
        where = f"{path}: figure {name!r}" if name else f"{path}: figure #{index} (no id)"
        figure = _figure(_built(_Entry, raw, where), book.chapters, where)
        if figure.id in seen:
            raise ConfigError(f"{where}: duplicate id")
        seen.add(figure.id)
        figures.append(figure)
    return Book(chapters=book.chapters, figures=figures)


def _built(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    """`cls` built from `data` by the schema, its errors prefixed by `where` (the file, the figure)."""
    try:
        return build(cls, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _figure(entry: _Entry, chapters: Mapping[int | str, str], where: str) -> Figure:
    if entry.chapter not in chapters:
        raise ConfigError(f"{where}: chapter: {entry.chapter!r} is not one of {_ordered(chapters)}")
    book, book_text = _book_value(entry.book, where)
    return Figure(
        id=entry.id,
        chapter=entry.chapter,
        description=entry.description,
        where=entry.where,
        book=book,
        book_text=book_text,
        tolerance=entry.tolerance,
        ours=entry.ours,
        needs=entry.needs,
        unit=entry.unit,
    )


_NUMBER = re.compile(r"-?\d{1,3}(,\d{3})+|-?\d+(\.\d+)?")


def _book_value(raw: Any, where: str) -> tuple[Value, str]:
    """The book's value and its printed form: "20,479" -> 20479, "45.00" -> 45.0 shown as 45.00,
    "[[0.4419, 1.0000], ...]" -> a nested list shown as written, any other string -> that text."""
    if isinstance(raw, bool):
        raise ConfigError(f"{where}: book: expected a number, a text or a list, got {raw!r}")
    if isinstance(raw, int | float):
        return raw, f"{raw:,}" if isinstance(raw, int) else repr(raw)
    if isinstance(raw, str) and _NUMBER.fullmatch(raw.strip()):
        text = raw.strip()
        plain = text.replace(",", "")
        return (float(plain) if "." in plain else int(plain)), text
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"{where}: book: {raw!r} is not a printed list (Python literal syntax)"
            ) from None
        _check_list(value, where)
        return value, raw.strip()
    if isinstance(raw, str):
        return raw, repr(raw)
    if isinstance(raw, list) and raw:
        _check_list(raw, where)
        return list(raw), _list_text(raw)
    raise ConfigError(f"{where}: book: expected a number, a text or a non-empty list, got {raw!r}")


def _check_list(value: Any, where: str) -> None:
    """Lists of numbers, texts and lists; `...` only as a list's last element."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: book: expected a non-empty list, got {value!r}")
    for index, item in enumerate(value):
        if item is Ellipsis and index == len(value) - 1 and index > 0:
            continue
        if isinstance(item, list):
            _check_list(item, where)
        elif isinstance(item, bool) or not isinstance(item, int | float | str):
            raise ConfigError(
                f"{where}: book: {item!r} in a list: expected numbers, texts, lists or a final ..."
            )


def _list_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_list_text(item) for item in value) + "]"
    return "..." if value is Ellipsis else repr(value) if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class RunInfo:
    """What is known about the run that wrote the reports folder (all of it optional)."""

    reports_dir: Path
    root: Path  # the project folder holding reports/ (and perhaps dvc.lock, params.yaml, .git)
    params: dict[str, Any]  # flattened params the run used
    params_origin: str | None  # "dvc.lock" or "params.yaml"
    profile: str | None
    commit: str | None

    @property
    def gpt2_source(self) -> str | None:
        return self.params.get("gpt2.source")

    @functools.cached_property
    def planned_gpt2_source(self) -> str | None:
        """The gpt2.source params.yaml asks for, read once: some 60 figures ask why theirs is unknown."""
        return _params_yaml(self.root).get("gpt2.source")

    def unknown_source(self) -> str:
        """Why the run's gpt2.source is not known."""
        if self.params_origin == "dvc.lock":
            planned = self.planned_gpt2_source
            asks = f"; params.yaml asks for gpt2.source: {planned}" if planned else ""
            return f"load-gpt2 has not run (no load-gpt2 stage in dvc.lock{asks})"
        return "gpt2.source unknown (no dvc.lock or params.yaml beside the reports)"

    def other_data(self, source: Source | None) -> str | None:
        """What of the user's own a figure's report rests on (None: the book's data, or unknown).

        A param absent from the run's params (an older run, or one without that knob) is the book's.
        The book's file also counts as the book's under another data.raw_dir.
        """
        if source is None or source.file is None:
            return None
        where = [source.file] + [f"{source.file}:{key}" for key in source.keys]
        for what, key, book, reports in _BOOK_DATA:
            value = self.params.get(key)
            if value is None or value in book or _under_raw_dir(value, book, self.params):
                continue
            if any(place.startswith(reports) for place in where):
                return f"{what} ({key}: {value}), not the book's: not compared"
        return None

    @classmethod
    def of_reports(cls, reports_dir: Path) -> RunInfo:
        root = reports_dir.resolve().parent
        params, origin = _run_params(root)
        commit = _git_commit(root, reports_dir.resolve() / REPORT_NAME)
        return cls(reports_dir, root, params, origin, _matching_profile(root, params), commit)


def _under_raw_dir(value: Any, book: tuple[str, ...], params: Mapping[str, Any]) -> bool:
    """Whether `value` is the book's file (one of `book`, under data/raw) where the run's data.raw_dir put it."""
    raw_dir = params.get("data.raw_dir")
    return raw_dir is not None and any(
        Path(value) == Path(raw_dir) / Path(path).relative_to("data/raw") for path in book if "/" in path
    )


def _run_params(root: Path) -> tuple[dict[str, Any], str | None]:
    """The params recorded in dvc.lock (what the stages ran with), else those in params.yaml."""
    try:
        lock = read_yaml(root / "dvc.lock")
        params: dict[str, Any] = {}
        for stage in (lock.get("stages") or {}).values():
            params.update(flatten((stage.get("params") or {}).get("params.yaml") or {}))
        if params:
            return params, "dvc.lock"
    except (OSError, yaml.YAMLError, AttributeError):
        pass
    params = _params_yaml(root)
    return (params, "params.yaml") if (root / "params.yaml").is_file() else ({}, None)


def _params_yaml(root: Path) -> dict[str, Any]:
    try:
        return flatten(read_yaml(root / "params.yaml") or {})
    except (OSError, yaml.YAMLError):
        return {}


def _matching_profile(root: Path, params: Mapping[str, Any]) -> str | None:
    """The profile in profiles/ whose every override the run's params hold, if exactly one."""
    matches = []
    for profile in sorted((root / "profiles").glob("*.yaml")):
        try:
            overrides = flatten(read_yaml(profile) or {})
        except (OSError, yaml.YAMLError):
            continue
        known = {key: value for key, value in overrides.items() if key in params}
        if known and all(params[key] == value for key, value in known.items()):
            matches.append(profile.stem)
    return matches[0] if len(matches) == 1 else None


def _git_commit(root: Path, report: Path) -> str | None:
    """The commit the reports were made from; "(uncommitted changes)" when tracked files other than
    the report itself differ from it (the report is committed after it is made from a clean tree)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        # A `gptlab smoke` workspace names the project's commit in trailers (gptlab.experiments.smoke.commit_workspace).
        source = git("log", "-1", "--format=%(trailers:key=Source-Commit,valueonly)")
        if source:
            dirty = git("log", "-1", "--format=%(trailers:key=Source-Dirty,valueonly)") == "true"
            commit = source[:7]
        else:
            commit = git("rev-parse", "--short", "HEAD")
            dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", f":!{report}"))
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit} (uncommitted changes)" if dirty else commit


# --------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Outcome:
    figure: Figure
    ours: Value | None
    status: str  # OK, OFF, NOT_RUN or OTHER_DATA
    reason: str = ""


class _Reports:
    """Reads (once each) the JSON and CSV files of a reports folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cache: dict[str, Any] = {}

    def _load(self, file: str) -> Any:
        if file not in self._cache:
            path = self.folder / file
            if not path.is_file():
                if file.startswith("sweeps/"):
                    raise NotRun(
                        f"sweep not run: no {file} in {self.folder.as_posix()}/ "
                        f"(`gptlab sweep {Path(file).stem}` writes it)"
                    )
                raise NotRun(f"stage not run: no {file} in {self.folder.as_posix()}/")
            text = path.read_text(encoding="utf-8")
            self._cache[file] = (
                json.loads(text) if file.endswith(".json") else list(csv.DictReader(text.splitlines()))
            )
        return self._cache[file]

    def value(self, source: Source) -> Value:
        assert source.file is not None, "a file source names its file"
        if source.column is None:
            total = sum(self._json_value(source.file, key) for key in source.keys)
            return total * source.scale if source.scale != 1 else total
        label = ", ".join(f"{k}={v}" for k, v in source.row.items())
        cell = self.row(source).get(source.column)
        if cell in (None, ""):
            raise NotRun(f"{source.file} has no {source.column} at {label}")
        return float(cell) * source.scale if source.scale != 1 else float(cell)

    def row(self, source: Source) -> dict[str, str]:
        """The first row of a CSV source's file whose columns hold the source's `row` values."""
        assert source.file is not None and source.column is not None, "a CSV source"
        rows = self._load(source.file)
        matching = [row for row in rows if all(_same(row.get(k), v) for k, v in source.row.items())]
        if not matching:
            label = ", ".join(f"{k}={v}" for k, v in source.row.items())
            raise NotRun(f"{source.file} has no row {label}")
        return matching[0]

    def _json_value(self, file: str, key: str) -> float:
        value: Any = self._load(file)
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise NotRun(f"{file} has no key {key}")
            value = value[part]
        if value is None:
            raise NotRun(f"{file} holds null for {key}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise NotRun(f"{file}: {key} is not a number")
        return value


def _same(cell: str | None, wanted: Any) -> bool:
    if cell is None:
        return False
    try:
        return float(cell) == float(wanted)
    except (TypeError, ValueError):
        return cell == str(wanted)


def compare(
    book: Book,
    reports_dir: Path,
    run: RunInfo | None = None,
    progress: Callable[[Figure], None] | None = None,
) -> list[Outcome]:
    """Each figure's outcome, in the data file's order; `progress` is told of each figure before it is read."""
    run = run or RunInfo.of_reports(reports_dir)
    reports = _Reports(reports_dir)
    outcomes = []
    for figure in book.figures:
        if progress is not None:
            progress(figure)
        other = run.other_data(figure.ours)
        try:
            ours = _our_value(figure, reports, run)
        except NotRun as exc:
            outcomes.append(Outcome(figure, None, OTHER_DATA if other else NOT_RUN, other or str(exc)))
            continue
        if other:
            outcomes.append(Outcome(figure, ours, OTHER_DATA, other))
            continue
        if figure.tolerance.allows(figure.book, ours):
            outcomes.append(Outcome(figure, ours, OK))
        else:
            outcomes.append(Outcome(figure, ours, OFF, _why_off(figure, ours, run)))
    return outcomes


def _why_off(figure: Figure, ours: Value, run: RunInfo) -> str:
    """How far from the book's value, and, for a profile's run, that it did not use the book's settings."""
    book = figure.book
    if isinstance(book, int | float) and isinstance(ours, int | float) and math.isfinite(ours):
        gap = f"{abs(ours - book):.{_decimals(figure.book_text) + 1}f}"
        why = f"off by {gap}{f' {figure.unit}' if figure.unit else ''}, more than the tolerance"
    else:
        why = "differs from the book's"
    if run.profile is not None:
        why += (
            f"; the run used the {run.profile} profile (profiles/{run.profile}.yaml), not the book's settings"
        )
    return why


def _our_value(figure: Figure, reports: _Reports, run: RunInfo) -> Value:
    if figure.needs is not None:
        gpt2_source, whose = run.gpt2_source, "this run's"
        row = _row_if_any(figure.ours, reports)
        if row is not None and row.get("gpt2.source"):  # a sweep's row: its own experiment's weights
            gpt2_source, whose = row["gpt2.source"], f"{figure.ours.file}'s row"  # type: ignore[union-attr]
        if gpt2_source != _OPENAI_SOURCE:
            why = f"{whose} gpt2.source is {gpt2_source}" if gpt2_source else run.unknown_source()
            raise NotRun(f"needs {figure.needs}; {why}")
    source = figure.ours
    if source is None:
        raise NotRun(f"needs {figure.needs}")
    if source.live is None:
        return reports.value(source)
    try:
        value = LIVE[source.live](run, **source.args)
    except InputError as exc:
        raise InputError(f"figure {figure.id!r}: ours.args: {exc}") from None
    return value * source.scale if source.scale != 1 and not isinstance(value, list) else value


def _row_if_any(source: Source | None, reports: _Reports) -> dict[str, str] | None:
    if source is None or source.column is None:
        return None
    try:
        return reports.row(source)
    except NotRun:
        return None


# --------------------------------------------------------------------------- rendering


def _ordered(chapters: Mapping[int | str, str]) -> list[int | str]:
    """Chapters by number, then appendices by letter."""
    return sorted(chapters, key=lambda c: (isinstance(c, str), str(c).zfill(3)))


def _heading(chapter: int | str) -> str:
    return f"Appendix {chapter}" if isinstance(chapter, str) else f"Chapter {chapter}"


def _decimals(text: str) -> int:
    """Decimals the book prints: the most any number in its printed form has."""
    numbers = re.findall(r"\d[\d,]*(?:\.(\d+))?", text)
    return max((len(decimals) for decimals in numbers), default=0)


def _show(figure: Figure, value: Value | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, list | str):
        return _show_value(value, _decimals(figure.book_text) + 1, "e-" in figure.book_text)
    if isinstance(figure.book, int) and float(value).is_integer():
        return f"{int(value):,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    # One digit more than the book prints, so a near miss shows.
    return f"{value:.{_decimals(figure.book_text) + 1}f}"


def _show_value(value: Any, decimals: int, scientific: bool) -> str:
    """Ours as the book prints it, floats with one digit more (a near miss shows)."""
    if isinstance(value, list):
        return "[" + ", ".join(_show_value(item, decimals, scientific) for item in value) + "]"
    if isinstance(value, float):
        return f"{value:.{decimals}e}" if scientific else f"{value:.{decimals}f}"
    return repr(value) if isinstance(value, str) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def tally(outcomes: list[Outcome]) -> str:
    """ "N ✓, N ✗, N not run" (and ", N other data" where some are) of the outcomes."""
    counts = {status: sum(o.status == status for o in outcomes) for status in (OK, OFF, NOT_RUN, OTHER_DATA)}
    other = f", {counts[OTHER_DATA]} other data" if counts[OTHER_DATA] else ""
    return f"{counts[OK]} ✓, {counts[OFF]} ✗, {counts[NOT_RUN]} not run{other}"


def render(book: Book, outcomes: list[Outcome], run: RunInfo, book_path: Path | str) -> str:
    lines = [
        "# Reproduction report: the book's figures beside ours",
        "",
        f"Written by `gptlab report` from `{run.reports_dir.as_posix()}/` and the book's figures in "
        f"`{Path(book_path).as_posix()}`.",
        "",
        f"- commit: {run.commit or 'unknown (not a git checkout)'}",
        f"- params: {_describe_params(run)}",
        f"- base models: {_describe_source(run)}",
        "",
        f"**{tally(outcomes)}** of {len(outcomes)} figures.",
        "",
        "How to read it: ✓ our value is within the tolerance of the book's, ✗ it is not (and by how "
        "much), and "
        "*not run* says why there is no value of ours (the stage has not run, it does not report that "
        "figure, or the figure needs OpenAI's weights). Each tolerance says why it is that wide: "
        "figures printed from a run on another device (the book's notebooks ran on Apple MPS / CUDA, "
        "whose dropout draws differ from a CPU's) get the spread seen between devices; properties of "
        "the code and the pinned data are exact. `ours from` names the report file and key each value "
        "is read from.",
    ]
    for chapter in _ordered(book.chapters):
        title = book.chapters[chapter]
        rows = [o for o in outcomes if o.figure.chapter == chapter]
        if not rows:
            continue
        lines += [
            "",
            f"## {_heading(chapter)}: {title}",
            "",
            "| figure | where the book prints it | book | ours | tolerance | status | ours from |",
            "|---|---|---|---|---|---|---|",
        ]
        for outcome in rows:
            figure = outcome.figure
            unit = f" {figure.unit}" if figure.unit else ""
            ours = _show(figure, outcome.ours)
            status = f"{outcome.status}: {outcome.reason}" if outcome.reason else outcome.status
            source = figure.ours.describe() if figure.ours else "—"
            cells = [
                f"{figure.description} (`{figure.id}`)",
                figure.where,
                figure.book_text + unit,
                ours + (unit if outcome.ours is not None else ""),
                figure.tolerance.describe(figure.unit),
                status,
                source,
            ]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _describe_params(run: RunInfo) -> str:
    if run.params_origin is None:
        return "unknown (no dvc.lock or params.yaml beside the reports)"
    profile = (
        f"the `{run.profile}` profile (profiles/{run.profile}.yaml)"
        if run.profile
        else "no profile's overrides (the params as committed, or hand-edited)"
    )
    return f"{profile}, as recorded in {run.params_origin}"


def _describe_source(run: RunInfo) -> str:
    source = run.gpt2_source
    if source == _OPENAI_SOURCE:
        return "OpenAI's GPT-2 weights (gpt2.source: huggingface): figures that need them are compared"
    if source is None:
        return f"{run.unknown_source()}: figures that need OpenAI's weights are not compared"
    return f"gpt2.source: {source}, not OpenAI's weights: figures that need them are not compared"


def make_report(
    book_path: Path | str = BOOK_FILE,
    reports_dir: Path | str = REPORTS,
    progress: Callable[[Figure], None] | None = None,
) -> tuple[str, list[Outcome]]:
    """The report's markdown text (also what gets logged to MLflow) and each figure's outcome."""
    book = load_book(book_path)
    reports_dir = Path(reports_dir)
    run = RunInfo.of_reports(reports_dir)
    outcomes = compare(book, reports_dir, run, progress)
    return render(book, outcomes, run, book_path), outcomes


def render_markdown(book_path: Path | str = BOOK_FILE, reports_dir: Path | str = REPORTS) -> str:
    """The report's markdown text alone."""
    return make_report(book_path, reports_dir)[0]


def write_report(
    out: Path | str | None = None,
    book_path: Path | str = BOOK_FILE,
    reports_dir: Path | str = REPORTS,
) -> tuple[Path, list[Outcome]]:
    """Write the report (default <reports_dir>/REPRODUCTION.md); returns its path and the outcomes."""
    text, outcomes = make_report(book_path, reports_dir)
    out = Path(out) if out is not None else Path(reports_dir) / REPORT_NAME
    save_report(text, out)
    return out, outcomes


def save_report(text: str, out: Path) -> None:
    """`text` at `out`, replaced in one step: never a half-written report."""
    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
