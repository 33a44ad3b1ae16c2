"""Compare a run's metrics with a committed baseline and flag regressions.

The baseline file names, for each metrics file under reports/, the metrics to
guard: the baseline value, which direction is better, and how far worse than
the baseline a value may be (absolute) before it counts as a regression. CI
runs the smoke profile and then this check, so a change that makes a model
worse fails the build; improving the baseline on purpose is one command.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.schema import ConfigError, build, flatten, read_yaml

BASELINES = Path("baselines")
DEFAULT_BASELINE = BASELINES / "smoke.yaml"


@dataclass(frozen=True)
class GuardedMetric:
    baseline: float
    direction: Literal["lower", "higher"]
    tolerance: float

    def __post_init__(self) -> None:
        if self.tolerance < 0:
            raise ConfigError(f"tolerance: expected a value >= 0, got {self.tolerance}")


@dataclass(frozen=True)
class Comparison:
    file: str
    metric: str
    guard: GuardedMetric
    current: float | None

    @property
    def change(self) -> float | None:
        return None if self.current is None else self.current - self.guard.baseline

    @property
    def status(self) -> str:
        if self.current is None or math.isnan(self.current):
            return "missing"
        worse_by = self.change if self.guard.direction == "lower" else -self.change  # type: ignore[operator]
        if worse_by > self.guard.tolerance:
            return "regressed"
        return "improved" if worse_by < -self.guard.tolerance else "ok"

    @property
    def failed(self) -> bool:
        return self.status in ("missing", "regressed")


def load_baseline(path: Path) -> dict[str, dict[str, GuardedMetric]]:
    """{metrics file relative to the reports dir: {flattened metric key: guard}}.

    Every way the file can be unusable (missing, not UTF-8, not YAML, the wrong shape, a bad
    guard) is an InputError naming the file, and the line for YAML errors.
    """
    data = _read_baseline(path)
    if not isinstance(data.get("metrics"), dict):
        raise InputError(f"{path}: expected a mapping with a `metrics` section")
    baseline: dict[str, dict[str, GuardedMetric]] = {}
    for file, metrics in data["metrics"].items():
        if not isinstance(metrics, dict):
            raise InputError(
                f"{path}: metrics.{file}: expected a mapping of metric names to guards "
                f"(baseline, direction, tolerance), got {type(metrics).__name__}"
            )
        try:
            baseline[str(file)] = {
                str(key): build(GuardedMetric, guard, f"metrics.{file}.{key}")
                for key, guard in metrics.items()
            }
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return baseline


def guarded_reports(path: Path) -> Path | None:
    """The reports folder baseline `path` belongs to (its `reports:` key, project-relative), if it names one.

    A baseline holds one run's values (the smoke profile's, the reference run's): checking or
    updating it against another run's reports would compare, or overwrite, across profiles.
    """
    folder = _read_baseline(path).get("reports")
    if folder is not None and not isinstance(folder, str):
        raise InputError(f"{path}: reports: expected the folder it guards, e.g. .gptlab/smoke/reports")
    return Path(folder) if folder else None


def _read_baseline(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise InputError(f"baseline {path}: is a directory, not a baseline file")
    if not path.is_file():
        raise InputError(f"baseline {path} not found")
    try:
        data = read_yaml(path) or {}
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InputError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping with a `metrics` section")
    return data


def pairs_to_check(baseline: Path | None, reports: Path | None) -> list[tuple[Path, Path]]:
    """Which (baseline, reports) pairs `gptlab metrics check` compares, from what was passed.

    Nothing: every baseline under baselines/ with the reports folder it names, where that exists.
    One of them: its partner. Both: that pair, as given.
    """
    if baseline is not None and reports is not None:
        return [(baseline, reports)]
    if baseline is not None:
        if (own := guarded_reports(baseline)) is None:
            raise InputError(f"{baseline} names no reports folder (`reports:`): pass --reports")
        return [(baseline, own)]
    known = {path: guarded_reports(path) for path in sorted(BASELINES.glob("*.yaml"))}
    if reports is not None:
        for path, own in known.items():
            if own is not None and _same(own, reports):
                return [(path, reports)]
        raise InputError(
            f"no baseline in {BASELINES}/ guards {reports}: pass --baseline, or create one with "
            f"`gptlab metrics update-baseline --baseline {BASELINES}/NAME.yaml --reports {reports}`"
        )
    found = [(path, own) for path, own in known.items() if own is not None and own.is_dir()]
    if not found:
        folders = ", ".join(str(own) for own in known.values() if own is not None) or "none named"
        raise InputError(
            f"no run to check: the baselines' reports folders ({folders}) do not exist; run "
            "`gptlab smoke` or `dvc repro` first, or pass --baseline and --reports"
        )
    return found


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _project_relative(folder: Path) -> Path:
    """`folder` relative to the project root (the working directory) when inside it, as baselines name it."""
    try:
        return folder.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return folder.resolve()


def flat_metrics(path: Path) -> dict[str, float]:
    """A metrics JSON file as {dotted.key: number}; non-numeric entries are left out."""
    flat: dict[str, float] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[prefix] = float(value)

    try:
        walk(json.loads(path.read_text(encoding="utf-8")), "")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc}); rerun the stage that writes it") from exc
    return flat


def compare(baseline: dict[str, dict[str, GuardedMetric]], reports_dir: Path) -> list[Comparison]:
    _check_reports_dir(reports_dir)
    rows = []
    for file, guards in baseline.items():
        path = reports_dir / file
        current = flat_metrics(path) if path.is_file() else {}
        for key, guard in guards.items():
            rows.append(Comparison(file, key, guard, current.get(key)))
    return rows


def check(baseline: Path, reports: Path) -> int:
    """Print the comparison table; 1 if any guarded metric regressed or is missing, else 0.

    A baseline or reports folder that cannot be read raises an InputError (exit code 2 in the CLI).
    """
    if not baseline.is_file():
        raise InputError(
            f"baseline {baseline} not found; create it from a run's reports with "
            f"`gptlab metrics update-baseline --baseline {baseline} --reports {reports}`"
        )
    rows = compare(load_baseline(baseline), reports)
    workspace = reports.resolve().parent
    if changed := workspace_params_changed(workspace):
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        print(
            f"{reports}: the workspace of {workspace}, whose params.yaml differs from its last commit "
            f"({shown}): the DVC experiment run or applied there last, not the committed run\n"
        )
    print(markdown_table(rows))
    failed = [row for row in rows if row.failed]
    if failed:
        names = ", ".join(f"{r.file}:{r.metric} ({r.status})" for r in failed)
        print(f"\nFAILED: {len(failed)} of {len(rows)} metrics regressed or missing: {names}")
        own = guarded_reports(baseline)
        if changed:
            print(
                f"To check a given experiment: (cd {workspace} && dvc exp apply NAME) && gptlab metrics "
                f"check --baseline {baseline} --reports {reports}; the committed run: "
                f"(cd {workspace} && git stash && dvc checkout), then the same check"
            )
        elif own is None or _same(own, reports):
            print(f"If the change is intended: gptlab metrics update-baseline --baseline {baseline}")
        else:
            print(
                f"{baseline} holds the values of {own}, not of {reports}: to guard these, give them "
                f"a baseline of their own (gptlab metrics update-baseline --baseline {BASELINES}/NAME.yaml "
                f"--reports {reports})"
            )
        return 1
    print(f"\nOK: {len(rows)} metrics within tolerance of {baseline}")
    return 0


def workspace_params_changed(workspace: Path) -> list[str]:
    """The params of `workspace`'s params.yaml that differ from its git HEAD's, flat ([] without either).

    `dvc exp run` (and `dvc exp apply`) leave an experiment's params and results in the workspace:
    its reports are then that experiment's, not the committed run's.
    """
    try:
        committed = subprocess.run(
            ["git", "show", "HEAD:./params.yaml"],
            cwd=workspace,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        now = flatten(read_yaml(workspace / "params.yaml") or {})
        before = flatten(yaml.safe_load(committed) or {})
    except (OSError, ValueError, subprocess.SubprocessError, yaml.YAMLError, AttributeError):
        return []
    return sorted(key for key in now.keys() | before.keys() if now.get(key) != before.get(key))


def _check_reports_dir(reports_dir: Path) -> None:
    if not reports_dir.is_dir():
        raise InputError(
            f"reports folder {reports_dir} not found: run the pipeline (`dvc repro` or `gptlab smoke`) "
            "first, or point --reports at its reports"
        )


def markdown_table(rows: list[Comparison]) -> str:
    """The comparison as a table in the style of `dvc metrics diff --md`."""
    lines = [
        "| Path | Metric | Baseline | Current | Change | Better | Tolerance | Status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        current = "—" if row.current is None else for_people(row.current)
        change = "—" if row.change is None else for_people(row.change, signed=True)
        lines.append(
            f"| {row.file} | {row.metric} | {for_people(row.guard.baseline)} | {current} | {change} "
            f"| {row.guard.direction} | {for_people(row.guard.tolerance)} | {row.status} |"
        )
    return "\n".join(lines)


def for_people(value: float, signed: bool = False) -> str:
    """`value` to 4 decimals without trailing zeros: 0.0001 is finer than any tolerance guards.

    A change of -2.67e-07 reads 0, not -2.67181e-07.
    """
    if not math.isfinite(value):
        return str(value)
    text = f"{value:{'+' if signed else ''},.4f}".rstrip("0").rstrip(".")
    return "0" if text.lstrip("+-") == "0" else text


def update_baseline(path: Path, reports_dir: Path) -> list[Comparison]:
    """Set every guarded metric's baseline to the current value; direction and tolerance stay.

    Only from the reports folder the baseline names: another folder is another run (a
    profile's, the reference run's), whose values would silently replace these.
    """
    own = guarded_reports(path)
    if own is not None and not _same(own, reports_dir):
        raise InputError(
            f"{path} holds the values of {own}, not of {reports_dir}: updating it from there would "
            f"replace one run's baseline with another's; create a baseline for {reports_dir} instead "
            f"(gptlab metrics update-baseline --baseline {BASELINES}/NAME.yaml --reports {reports_dir})"
        )
    baseline = load_baseline(path)
    rows = compare(baseline, reports_dir)
    missing = [f"{r.file}:{r.metric}" for r in rows if r.status == "missing"]
    if missing:
        raise InputError(
            f"cannot update {path}: {reports_dir} has no current value for {', '.join(missing)}; "
            "run the stages that write them, or remove those entries from the baseline"
        )
    data = read_yaml(path)
    for row in rows:
        data["metrics"][row.file][row.metric]["baseline"] = round(float(row.current), 6)  # type: ignore[arg-type]
    header = "".join(
        line + "\n" for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")
    )
    _write_text(path, header + yaml.safe_dump(data, sort_keys=False))
    return rows


# A new baseline guards the quality metrics it can tell the better direction of, with these
# default tolerances (absolute, or relative to the value); counts such as steps are left out.
RELATIVE_LOSS_TOLERANCE = 0.01  # losses: 1% of the value, at least MIN_LOSS_TOLERANCE
MIN_LOSS_TOLERANCE = 0.01
RELATIVE_PERPLEXITY_TOLERANCE = 0.05  # exp(loss): 1% of a loss of ~5 moves it by ~5%
SCORE_TOLERANCE = 0.03  # accuracy, precision, recall, F1, ROUGE: fractions in [0, 1]
JUDGE_TOLERANCE = 3.0  # the judge's mean score, 0-100
_SCORES = frozenset({"accuracy", "precision", "recall", "f1", "f1_score"})


def default_guard(key: str, value: float) -> GuardedMetric | None:
    """The guard a new baseline gives metric `key` (None: not a metric with a better direction)."""
    if not math.isfinite(value):
        return None
    name = key.rsplit(".", 1)[-1].lower()
    if "perplexity" in name:
        return GuardedMetric(_round(value), "lower", _round(abs(value) * RELATIVE_PERPLEXITY_TOLERANCE, 3))
    if "loss" in name:
        tolerance = max(abs(value) * RELATIVE_LOSS_TOLERANCE, MIN_LOSS_TOLERANCE)
        return GuardedMetric(_round(value), "lower", _round(tolerance, 3))
    if name.removeprefix("macro_") in _SCORES or name.startswith("rouge"):
        return GuardedMetric(_round(value), "higher", SCORE_TOLERANCE)
    if key.lower() == "judge.mean":
        return GuardedMetric(_round(value), "higher", JUDGE_TOLERANCE)
    return None


def create_baseline(path: Path, reports_dir: Path) -> list[Comparison]:
    """Write a new baseline at `path` guarding every quality metric under `reports_dir`.

    Each `<stage>/metrics.json` is read; losses and perplexities are guarded as lower-is-better,
    accuracies, precision, recall, F1, ROUGE and the judge's mean as higher-is-better, with the
    default tolerances above. Refuses an existing file (update it instead) and writes nothing when
    there is no metric to guard.
    """
    if path.exists():
        raise InputError(f"{path} already exists; update it instead of creating it")
    _check_reports_dir(reports_dir)
    baseline: dict[str, dict[str, GuardedMetric]] = {}
    for metrics_file in sorted(reports_dir.rglob("metrics.json")):
        guards = {
            key: guard
            for key, value in flat_metrics(metrics_file).items()
            if (guard := default_guard(key, value)) is not None
        }
        if guards:
            baseline[metrics_file.relative_to(reports_dir).as_posix()] = guards
    if not baseline:
        raise InputError(
            f"no metrics to guard in {reports_dir}: expected <stage>/metrics.json files with losses, "
            "perplexities or accuracies; run the pipeline (`dvc repro` or `gptlab smoke`) first"
        )
    data = {
        "reports": _project_relative(reports_dir).as_posix(),
        "metrics": {
            file: {
                key: {"baseline": g.baseline, "direction": g.direction, "tolerance": g.tolerance}
                for key, g in guards.items()
            }
            for file, guards in baseline.items()
        },
    }
    header = (
        f"# Metrics baseline created by `gptlab metrics update-baseline` from {reports_dir}.\n"
        "# `gptlab metrics check` fails when a metric is worse than `baseline` by more than\n"
        "# `tolerance` in the given direction (lower or higher is better). Default tolerances:\n"
        "# losses 1% (at least 0.01), perplexities 5%, accuracy/precision/recall/F1/ROUGE 0.03,\n"
        "# the judge's mean 3 points; counts (steps, tokens) are not guarded. Edit freely.\n"
        f"# Accept new values on purpose: gptlab metrics update-baseline --baseline {path}\n"
    )
    _write_text(path, header + yaml.safe_dump(data, sort_keys=False))
    return compare(baseline, reports_dir)


def _round(value: float, digits: int = 7) -> float:
    """`value` to `digits` significant digits, so the YAML stays readable."""
    return float(f"{value:.{digits}g}")


def _write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
