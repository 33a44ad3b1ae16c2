"""dvc.yaml's code dependencies are right by construction: each stage lists exactly what it imports.

A stage's code is its script plus every module of src/gptlab that the script
imports, directly or through other modules (package __init__ files included,
since importing a module runs them). Listing too little lets DVC skip a rerun
after a change that matters; listing too much reruns stages for nothing.
"""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest
import yaml

from helpers import PROJECT_ROOT

SRC = PROJECT_ROOT / "src"


def module_file(name: str) -> Path | None:
    """The file of module `name` under src/, or None when it is not one of ours."""
    base = SRC.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Every gptlab module a file imports, wherever in the file the import stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from gptlab.data import spam` imports the submodule gptlab.datasets.spam.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "gptlab" and module_file(name)}


def import_closure(script: Path) -> set[str]:
    """Project-relative paths of the script and every src/gptlab file it needs."""
    files = {script}
    todo = [script]
    while todo:
        for name in imported_modules(todo.pop()):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):  # the packages on the way run their __init__
                file = module_file(".".join(parts[:depth]))
                if file is not None and file not in files:
                    files.add(file)
                    todo.append(file)
    return {file.relative_to(PROJECT_ROOT).as_posix() for file in files}


def stages() -> dict[str, dict]:
    return yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_lists_exactly_the_code_it_imports(name: str) -> None:
    stage = stages()[name]
    script = PROJECT_ROOT / shlex.split(stage["cmd"])[-1]
    code = {dep for dep in stage["deps"] if dep.startswith(("src/", "stages/"))}
    needed = import_closure(script)
    assert not code - needed, (
        f"{name}: dvc.yaml lists code the stage does not import: {sorted(code - needed)}"
    )
    assert not needed - code, f"{name}: dvc.yaml misses code the stage imports: {sorted(needed - code)}"


def test_closure_follows_imports_through_packages() -> None:
    closure = import_closure(PROJECT_ROOT / "stages" / "tokenize_data.py")
    assert "src/gptlab/data/spam.py" in closure  # `from gptlab.data import ... spam ...`
    assert "src/gptlab/data/__init__.py" in closure
    assert "src/gptlab/files.py" in closure  # imported by the datasets, not by the script
    assert not any(path.startswith("src/gptlab/cli/") for path in closure)


def test_how_a_model_is_served_is_no_stages_code() -> None:
    """The pyfunc classes that MLflow loads change no stage's output: editing them reruns no stage.

    The training stages log their models through gptlab.serving.specs, never pyfunc_models.py.
    """
    served = "src/gptlab/serving/pyfunc_models.py"
    for name, stage in stages().items():
        assert served not in import_closure(PROJECT_ROOT / shlex.split(stage["cmd"])[-1]), name
