"""The GitHub workflow users get: valid for GitHub, and running only commands the README gives."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from gptlab.experiments.smoke import SMOKE_WORKDIR
from gptlab.paths import REPORTS

from helpers import PROJECT_ROOT

WORKFLOW = PROJECT_ROOT / ".github" / "workflows" / "ci.yml"
README = PROJECT_ROOT / "README.md"
# The commands compared: the project's tools and the Python around them (not echo, cd, tee ...).
TOOLS = ("gptlab", "dvc", "pip", "python")
SEPARATORS = {"&&", "||", ";", "|", "(", ")"}


def shell_commands(script: str) -> set[str]:
    """The TOOLS commands of a shell script, normalised, each as `cd DIR && CMD` when a `cd` precedes it.

    What a command's output is redirected or piped into is not part of it.
    """
    commands: set[str] = set()
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segments: list[list[str]] = [[]]
        for token in lexer:
            if token in SEPARATORS:
                segments.append([])
            else:
                segments[-1].append(token)
        cwd = None
        for words in filter(None, segments):
            if words[0] == "cd":
                cwd = words[1]
            elif words[0] in TOOLS:
                redirect = next((i for i, word in enumerate(words) if word.startswith(">")), len(words))
                command = shlex.join(words[:redirect])
                commands.add(f"cd {cwd} && {command}" if cwd else command)
    return commands


def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))


def workflow_steps() -> list[dict[str, Any]]:
    return [step for job in workflow()["jobs"].values() for step in job["steps"]]


def workflow_commands() -> set[str]:
    return set().union(*(shell_commands(step["run"]) for step in workflow_steps() if "run" in step))


def readme_commands() -> set[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    return set().union(*map(shell_commands, blocks))


def check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema against its bundled copy of GitHub's workflow schema (no network needed)."""
    exe = Path(sys.executable).with_name("check-jsonschema")
    return subprocess.run(
        [
            str(exe) if exe.is_file() else "check-jsonschema",
            "--builtin-schema",
            "vendor.github-workflows",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_workflow_is_valid_for_github(tmp_path: Path) -> None:
    checked = check_jsonschema(WORKFLOW)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The same file without its runner is refused, so the check above did check.
    text = WORKFLOW.read_text(encoding="utf-8")
    broken = re.sub(r"^ *runs-on:.*\n", "", text, flags=re.M)
    assert broken != text
    (tmp_path / "broken.yml").write_text(broken, encoding="utf-8")
    refused = check_jsonschema(tmp_path / "broken.yml")
    assert refused.returncode == 1 and "runs-on" in refused.stdout, refused.stdout + refused.stderr


def test_the_workflow_runs_only_commands_the_readme_gives() -> None:
    ours, documented = workflow_commands(), readme_commands()
    assert ours - documented == set(), "the workflow runs commands the README does not give"
    # It checks the smoke run's metrics where `gptlab smoke` writes them.
    smoke_reports = (SMOKE_WORKDIR / REPORTS).as_posix()
    assert f"gptlab metrics check --reports {smoke_reports}" in ours
    assert f"cd {SMOKE_WORKDIR.as_posix()} && dvc metrics diff --md --all" in ours
    assert any(command.startswith("gptlab smoke") for command in ours)


def test_the_inputs_it_caches_are_the_mirror_the_stages_read() -> None:
    (cache,) = [
        step["with"]["path"] for step in workflow_steps() if step.get("uses", "").startswith("actions/cache")
    ]
    (job,) = workflow()["jobs"].values()
    assert job["env"]["GPTLAB_MIRROR"] == cache
    assert shlex.join(["gptlab", "mirror", cache, "--no-weights"]) in workflow_commands()
