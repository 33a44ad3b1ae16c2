"""The house rules a reader relies on: functions that fit a screen, a loop that knows nothing of MLflow.

The sources are parsed in a fresh interpreter: CPython 3.11's AST converter can fail
with "AST constructor recursion depth mismatch" in a process that other tests left
threads running in (CPython gh-106905), and these rules are about the files alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

from helpers import PROJECT_ROOT

MAX_FUNCTION_LINES = 80

# For each file: its functions (name, first line, last line) and the modules it imports.
OUTLINE = """
import ast, json, sys
outline = {}
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    functions, imports = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.append([node.name, node.lineno, node.end_lineno])
        elif isinstance(node, ast.ImportFrom) and node.module:
            imports.add(node.module)
        elif isinstance(node, ast.Import):
            imports.update(alias.name for alias in node.names)
    outline[path] = {"functions": functions, "imports": sorted(imports)}
print(json.dumps(outline))
"""


def python_files() -> list[Path]:
    return sorted(p for folder in ("src/gptlab", "stages") for p in (PROJECT_ROOT / folder).rglob("*.py"))


@cache
def outline() -> dict[Path, dict[str, list]]:
    done = subprocess.run(
        [sys.executable, "-c", OUTLINE, *map(str, python_files())], capture_output=True, text=True, check=True
    )
    return {Path(path): facts for path, facts in json.loads(done.stdout).items()}


def test_no_function_in_the_package_or_the_stages_is_longer_than_a_screen() -> None:
    too_long = [
        f"{path.relative_to(PROJECT_ROOT)}:{first} {name} ({last - first + 1} lines)"
        for path, facts in outline().items()
        for name, first, last in facts["functions"]
        if last - first + 1 > MAX_FUNCTION_LINES
    ]
    assert outline() and not too_long, too_long


def test_the_training_loop_and_its_helpers_import_no_tracking() -> None:
    package = PROJECT_ROOT / "src" / "gptlab"
    for name in ("training/loop.py", "training/data_order.py", "training/resume.py", "model/checkpoint.py"):
        modules = outline()[package / name]["imports"]
        assert not {m for m in modules if m.startswith("gptlab.tracking") or m.startswith("mlflow")}, name
