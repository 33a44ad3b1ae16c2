"""A stage starts without the libraries it uses only later: MLflow, pandas, matplotlib, scikit-learn ...

`import mlflow` alone takes over a second (its __init__ loads mlflow.genai, mlflow.artifacts,
mlflow.models and pandas), scikit-learn and rouge_score another; each is imported where it is
used, so a stage's script, and its reading of the params file, load only torch. Checked by
what a fresh interpreter has in sys.modules, not by timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT

# download.py first: the one stage that never loads torch, checked before any other has.
STAGE_SCRIPTS = sorted(
    (PROJECT_ROOT / "stages").glob("*.py"), key=lambda p: (p.name != "download.py", p.name)
)
# Loaded by a stage once it logs, plots or scores; never by its start-up.
LATER = (
    "mlflow",
    "pandas",
    "matplotlib",
    "sklearn",
    "scipy",
    "rouge_score",
    "transformers",
    "huggingface_hub",
    "torch._dynamo",  # ~1.5 s; only train.compile needs it
)


def added_by_each(
    step: str, scripts: list[Path], watched: tuple[str, ...], cwd: Path
) -> dict[str, list[str]]:
    """Run `step` for each script in turn, in one fresh interpreter: which of `watched` each one
    imported first. One interpreter for all: a fresh one costs seconds of torch's start-up, and a
    module imported stays imported, so the script after which it is first seen is the one to blame."""
    code = (
        "import json, runpy, sys\n"
        f"for script in {[str(s) for s in scripts]!r}:\n"
        + "".join(f"    {line}\n" for line in step.splitlines())
        + f"    print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(scripts), done.stdout  # nothing else printed
    added, seen = {}, set()
    for script, line in zip(scripts, lines, strict=True):
        loaded = json.loads(line)
        added[script.name] = [m for m in loaded if m not in seen]
        seen.update(loaded)
    return added


IMPORT = "runpy.run_path(script, run_name='startup_check')"
# A missing params file: the script exits 2 (printing nothing to stdout) before it loads anything more.
BAD_PARAMS = (
    "sys.argv = [script, '--params', 'missing.yaml']\n"
    "try:\n"
    "    runpy.run_path(script, run_name='__main__')\n"
    "except SystemExit as exit:\n"
    "    assert exit.code == 2, (script, exit.code)"
)


def test_download_starts_without_torch_or_what_it_uses_later(tmp_path: Path) -> None:
    """download.py alone (no torch to start: the fast tier's check); the slow test below covers every stage."""
    (download,) = [s for s in STAGE_SCRIPTS if s.name == "download.py"]
    assert added_by_each(IMPORT, [download], ("torch", *LATER), PROJECT_ROOT) == {"download.py": []}
    assert added_by_each(BAD_PARAMS, [download], ("torch", *LATER), tmp_path) == {"download.py": []}


@pytest.mark.slow
def test_a_stage_module_imports_none_of_what_it_uses_later() -> None:
    added = added_by_each(IMPORT, STAGE_SCRIPTS, LATER, PROJECT_ROOT)
    assert added == {script.name: [] for script in STAGE_SCRIPTS}, "imported at start-up"


@pytest.mark.slow
def test_a_bad_params_file_is_answered_before_mlflow_loads(tmp_path: Path) -> None:
    added = added_by_each(BAD_PARAMS, STAGE_SCRIPTS, ("torch", *LATER), tmp_path)
    # download trains nothing: it never needs torch, not even to ask whether it runs under torchrun.
    assert added.pop("download.py") == []
    assert {name: [m for m in modules if m != "torch"] for name, modules in added.items()} == {
        name: [] for name in added
    }, f"loaded before reading the params: {added}"
    assert ["torch"] in added.values()  # by the first stage that trains


@pytest.mark.slow
@pytest.mark.parametrize("verbose", ["", "1"])
def test_mlflow_imported_on_first_use_still_prints_warnings_only(verbose: str, tmp_path: Path) -> None:
    """MLflow sets its logger's level as it is imported: gptlab's quieting must come after it."""
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "GPTLAB_VERBOSE": verbose,
    }
    code = (
        "from gptlab.tracking.runs import stage_run\n"
        "with stage_run('check', 'startup-check', {'a': 1}, system_metrics=True) as run:\n"
        "    run.log_metrics({'x': 1.0})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    info = [line for line in done.stderr.splitlines() if " INFO mlflow" in line]
    if verbose:
        assert any("Started monitoring system metrics" in line for line in info), done.stderr
    else:
        assert info == [], done.stderr
