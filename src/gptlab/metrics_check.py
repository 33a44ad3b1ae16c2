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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from gptlab.errors import InputError
from gptlab.files import atomic_path
from gptlab.typed_config import ConfigError, build

DEFAULT_BASELINE = Path("baselines/smoke.yaml")


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
    """{metrics file relative to the reports dir: {flattened metric key: guard}}."""
    if not path.is_file():
        raise FileNotFoundError(f"baseline {path} not found; create it with `gptlab metrics update-baseline`")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise ConfigError(f"{path}: expected a mapping with a `metrics` section")
    return {
        file: {key: build(GuardedMetric, guard, f"metrics.{file}.{key}") for key, guard in metrics.items()}
        for file, metrics in data["metrics"].items()
    }


def flat_metrics(path: Path) -> dict[str, float]:
    """A metrics JSON file as {dotted.key: number}; non-numeric entries are left out."""
    flat: dict[str, float] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[prefix] = float(value)

    walk(json.loads(path.read_text(encoding="utf-8")), "")
    return flat


def compare(baseline: dict[str, dict[str, GuardedMetric]], reports_dir: Path) -> list[Comparison]:
    rows = []
    for file, guards in baseline.items():
        path = reports_dir / file
        current = flat_metrics(path) if path.is_file() else {}
        for key, guard in guards.items():
            rows.append(Comparison(file, key, guard, current.get(key)))
    return rows


def markdown_table(rows: list[Comparison]) -> str:
    """The comparison as a table in the style of `dvc metrics diff --md`."""
    lines = [
        "| Path | Metric | Baseline | Current | Change | Better | Tolerance | Status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        current = "—" if row.current is None else f"{row.current:.6g}"
        change = "—" if row.change is None else f"{row.change:+.6g}"
        lines.append(
            f"| {row.file} | {row.metric} | {row.guard.baseline:.6g} | {current} | {change} "
            f"| {row.guard.direction} | {row.guard.tolerance:.6g} | {row.status} |"
        )
    return "\n".join(lines)


def update_baseline(path: Path, reports_dir: Path) -> list[Comparison]:
    """Set every guarded metric's baseline to the current value; direction and tolerance stay."""
    baseline = load_baseline(path)
    rows = compare(baseline, reports_dir)
    missing = [f"{r.file}:{r.metric}" for r in rows if r.status == "missing"]
    if missing:
        raise InputError(f"cannot update the baseline: no current value for {', '.join(missing)}")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    for row in rows:
        data["metrics"][row.file][row.metric]["baseline"] = round(float(row.current), 6)  # type: ignore[arg-type]
    header = "".join(
        line + "\n" for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")
    )
    with atomic_path(path) as tmp:
        tmp.write_text(header + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return rows
