"""The house rules a reader relies on: functions that fit a screen, a loop that knows nothing of MLflow,
imports at a module's top unless a comment says why one waits for its function (start-up time).

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

# For each file: its functions (name, first line, last line), the modules it imports, and the
# imports inside a function that no comment explains: none on the import's lines, nor on the
# line just above the run of consecutive imports it belongs to.
OUTLINE = """
import ast, io, json, sys, tokenize

def local_import_runs(node, inside=False):
    inside = inside or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    for _, value in ast.iter_fields(node):
        run = []
        for child in value if isinstance(value, list) else [value]:
            if inside and isinstance(child, ast.Import | ast.ImportFrom):
                run.append(child)
                continue
            if run:
                yield run
                run = []
            if isinstance(child, ast.AST):
                yield from local_import_runs(child, inside)
        if run:
            yield run

outline = {}
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    tree = ast.parse(source)
    functions, imports = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.append([node.name, node.lineno, node.end_lineno])
        elif isinstance(node, ast.ImportFrom) and node.module:
            imports.add(node.module)
        elif isinstance(node, ast.Import):
            imports.update(alias.name for alias in node.names)
    comments, comment_lines = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
            if not token.line[: token.start[1]].strip():
                comment_lines.add(token.start[0])
    unexplained = [
        [node.lineno, ast.get_source_segment(source, node).splitlines()[0]]
        for run in local_import_runs(tree)
        if run[0].lineno - 1 not in comment_lines
        for node in run
        if not comments.intersection(range(node.lineno, node.end_lineno + 1))
    ]
    outline[path] = {"functions": functions, "imports": sorted(imports), "unexplained": unexplained}
print(json.dumps(outline))
"""


def python_files() -> list[Path]:
    return sorted(p for folder in ("src/gptlab", "stages") for p in (PROJECT_ROOT / folder).rglob("*.py"))


def outline_of(paths: list[Path]) -> dict[Path, dict[str, list]]:
    done = subprocess.run(
        [sys.executable, "-c", OUTLINE, *map(str, paths)], capture_output=True, text=True, check=True
    )
    return {Path(path): facts for path, facts in json.loads(done.stdout).items()}


@cache
def outline() -> dict[Path, dict[str, list]]:
    return outline_of(python_files())


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


def test_an_import_inside_a_function_says_why_it_waits() -> None:
    unexplained = [
        f"{path.relative_to(PROJECT_ROOT)}:{line} {text}"
        for path, facts in outline().items()
        for line, text in facts["unexplained"]
    ]
    assert outline()
    assert not unexplained, "no comment says why these wait for their function:\n" + "\n".join(unexplained)


SAMPLE = """\
import os


def explained():
    # torch on first use: keeps start-up fast
    import torch

    from gptlab.model.gpt import GPTModel


def explained_on_their_lines():
    import json  # its own reason
    from gptlab.model.config import (
        ModelConfig,  # a reason inside the statement
    )


def unexplained():
    import json
    # a comment on the code below, not on the run of imports above
    x = 1
    import sys


def too_far_above():
    # a comment with a blank line below it

    import re


class Model:
    def method(self):
        import math
"""


def test_the_import_check_finds_an_import_without_its_reason(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE, encoding="utf-8")
    unexplained = outline_of([sample])[sample]["unexplained"]
    assert unexplained == [[19, "import json"], [22, "import sys"], [28, "import re"], [33, "import math"]]
