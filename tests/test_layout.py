"""The house rules a reader relies on: functions that fit a screen, a loop that knows nothing of MLflow."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import PROJECT_ROOT

MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    return sorted(p for folder in ("src/gptlab", "stages") for p in (PROJECT_ROOT / folder).rglob("*.py"))


def test_no_function_in_the_package_or_the_stages_is_longer_than_a_screen() -> None:
    too_long = [
        f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in python_files()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, too_long


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_training_loop_and_its_helpers_import_no_tracking() -> None:
    package = PROJECT_ROOT / "src" / "gptlab"
    for name in ("train.py", "data_order.py", "resume.py", "checkpoint.py"):
        modules = imported(package / name)
        assert not {m for m in modules if m == "gptlab.tracking" or m.startswith("mlflow")}, name
