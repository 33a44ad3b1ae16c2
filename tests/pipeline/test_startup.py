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

STAGE_SCRIPTS = sorted((PROJECT_ROOT / "stages").glob("*.py"))
# Every stage but download.py loads torch as it starts: seconds for each fresh interpreter.
STAGES = [
    pytest.param(script, id=script.name, marks=() if script.name == "download.py" else pytest.mark.slow)
    for script in STAGE_SCRIPTS
]
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


def modules_after(code: str, watched: tuple[str, ...], cwd: Path) -> tuple[list[str], list[str]]:
    """Run `code` in a fresh interpreter; the lines it printed, and which of `watched` it had imported."""
    probe = f"\nimport json, sys\nprint(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code + probe], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    *lines, loaded = done.stdout.splitlines()
    return lines, json.loads(loaded)


@pytest.mark.parametrize("script", STAGES)
def test_a_stage_module_imports_none_of_what_it_uses_later(script: Path) -> None:
    code = f"import runpy\nrunpy.run_path({str(script)!r}, run_name='startup_check')"
    _, loaded = modules_after(code, LATER, PROJECT_ROOT)
    assert loaded == [], f"{script.name} imports at start-up: {loaded}"


@pytest.mark.parametrize("script", STAGES)
def test_a_bad_params_file_is_answered_before_mlflow_loads(script: Path, tmp_path: Path) -> None:
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(script)!r}, '--params', 'missing.yaml']\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print('exit', exit.code)"
    )
    lines, loaded = modules_after(code, ("torch", *LATER), tmp_path)
    assert lines == ["exit 2"]
    # download trains nothing: it never needs torch, not even to ask whether it runs under torchrun.
    expected = [] if script.name == "download.py" else ["torch"]
    assert loaded == expected, f"{script.name} loads before reading its params: {loaded}"


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
