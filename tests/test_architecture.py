"""The package's tree is its architecture: sub-packages by layer, each importing only downward.

Bottom to top: the foundation modules at the top of the package (errors, files,
paths, schema, environment), then model, data, training, tasks, tracking,
serving, pipeline, experiments, book and cli. A module may import the foundation,
its own sub-package and the layers below it, never one above (function-local
imports count too: they run all the same, and so does a module loaded by its
name, `importlib.import_module("gptlab...")`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "src" / "gptlab"
LAYERS = [
    "model",
    "data",
    "training",
    "tasks",
    "tracking",
    "serving",
    "pipeline",
    "experiments",
    "book",
    "cli",
]
MAX_TOP_LEVEL_MODULES = 8


def layer_of(module: str) -> int:
    """-1 for the foundation (gptlab itself and its top-level modules), else the layer's rank."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return -1


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def gptlab_imports(path: Path) -> set[str]:
    """The gptlab modules (and names) a file imports, wherever in it, `if TYPE_CHECKING:` included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if node.module == "gptlab")
        elif loaded := _loaded_by_name(node):
            found.add(loaded)
    return {name for name in found if name.split(".")[0] == "gptlab"}


def _loaded_by_name(node: ast.AST) -> str | None:
    """The module that `importlib.import_module("NAME")` or `__import__("NAME")` loads, when NAME is written out."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    loaded = node.args[0].value
    return loaded if name in ("import_module", "__import__") and isinstance(loaded, str) else None


def upward_imports(module: str, path: Path) -> list[str]:
    return sorted(name for name in gptlab_imports(path) if layer_of(name) > layer_of(module))


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_a_module_imports_only_its_own_layer_and_those_below(path: Path) -> None:
    module = module_name(path)
    upward = upward_imports(module, path)
    assert not upward, f"{module} (layer {layer_of(module)}) imports from a higher layer: {upward}"


def test_the_package_top_holds_only_the_foundation_and_the_layers() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(LAYERS)


def test_tracking_imports_nothing_of_tasks() -> None:
    """Tracking logs and registers models; what they are for (tasks) is the serving layer's, above it."""
    tracking = sorted((PACKAGE / "tracking").rglob("*.py"))
    found = {
        module_name(path): sorted(
            name for name in gptlab_imports(path) if layer_of(name) == LAYERS.index("tasks")
        )
        for path in tracking
    }
    assert tracking and not any(found.values()), found


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_says_its_job_in_its_init(layer: str) -> None:
    docstring = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8")))
    assert docstring and len(docstring.splitlines()) == 1, f"gptlab.{layer}: a one-line docstring"


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's other modules, function-local and type-only ones included."""
    names = {module_name(path) for path in MODULES}
    return {
        module_name(path): {name for name in gptlab_imports(path) if name in names} - {module_name(path)}
        for path in MODULES
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach themselves through their imports, as the cycles a depth-first walk meets."""
    cycles, done = [], set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            walk(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    assert not import_cycles(import_graph())


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"gptlab.a": {"gptlab.b"}, "gptlab.b": {"gptlab.c"}, "gptlab.c": {"gptlab.a"}, "gptlab.d": set()}
    assert import_cycles(graph) == [["gptlab.a", "gptlab.b", "gptlab.c", "gptlab.a"]]


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "loop.py"
    source.write_text(
        "from gptlab.errors import GptlabError\nfrom gptlab.model.gpt import GPTModel\n\n\n"
        "def log():\n    from gptlab.tracking.runs import stage_run\n\n\n"
        "def serve():\n    importlib.import_module('gptlab.serving.pyfunc_models')\n",
        encoding="utf-8",
    )
    assert upward_imports("gptlab.training.loop", source) == [
        "gptlab.serving.pyfunc_models",
        "gptlab.tracking.runs",
    ]
    assert upward_imports("gptlab.cli.main", source) == []
