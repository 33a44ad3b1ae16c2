"""The README's smoke-model examples print what the README says they print.

The commands are read from the README's console block (`$ ` lines, each followed by its stdout),
so editing the README changes what runs here. They need a smoke run's workspace: the one CI's
smoke run left ($GPTLAB_TEST_SMOKE_WORKSPACE, set by .ci/run), else the project's own
.gptlab/smoke after a `gptlab smoke`; without either the test makes one with `gptlab smoke`
(a few minutes, once per session; hence `slow`). A probability may
move in its last digits with the machine's kernels: it is compared within PROBABILITY_SLACK,
the labels and texts exactly.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT

WORKSPACE_ENV = "GPTLAB_TEST_SMOKE_WORKSPACE"
SMOKE_WORKSPACE = Path(".gptlab") / "smoke"
PROBABILITY_SLACK = 0.05
CONSOLE_BLOCK = re.compile(r"```console\n(.*?)```", re.DOTALL)


def readme_examples() -> list[tuple[str, list[str]]]:
    """Each `$ gptlab ...` line of the README's console blocks that use the smoke models, with its output lines."""
    examples: list[tuple[str, list[str]]] = []
    for block in CONSOLE_BLOCK.findall((PROJECT_ROOT / "README.md").read_text(encoding="utf-8")):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:], []))
            elif examples:
                examples[-1][1].append(line)
    return [(command, out) for command, out in examples if f"{SMOKE_WORKSPACE}/models/" in command]


@pytest.fixture(scope="session")
def smoke_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smoke run's workspace with its models: the one named or the project's, else a new one."""
    given = os.environ.get(WORKSPACE_ENV)
    found = Path(given) if given else PROJECT_ROOT / SMOKE_WORKSPACE
    if (found / "models" / "spam" / "config.json").is_file():
        return found
    made = tmp_path_factory.mktemp("smoke") / "workspace"
    env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{made.parent / 'mlflow.db'}"}
    done = subprocess.run(
        [sys.executable, "-m", "gptlab.cli.main", "smoke", "--no-check", "--workdir", str(made)],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return made


def test_the_readme_shows_a_spam_and_a_chat_example() -> None:
    commands = [shlex.split(command)[:2] for command, _ in readme_examples()]
    assert commands == [["gptlab", "classify"], ["gptlab", "chat"]]


def same_line(printed: str, shown: str) -> bool:
    """One output line: equal, but for a probability (`label<TAB>p<TAB>text`) within the slack."""
    got, want = printed.split("\t"), shown.split("\t")
    if len(got) == len(want) == 3 and got[0] == want[0] and got[2] == want[2]:
        return abs(float(got[1]) - float(want[1])) <= PROBABILITY_SLACK
    return printed == shown


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,shown", readme_examples(), ids=lambda v: v.split()[1] if isinstance(v, str) else ""
)
def test_the_readme_smoke_model_examples_print_what_it_shows(
    command: str, shown: list[str], tmp_path: Path, smoke_workspace: Path
) -> None:
    (tmp_path / SMOKE_WORKSPACE).parent.mkdir()
    (tmp_path / SMOKE_WORKSPACE).symlink_to(smoke_workspace.resolve())
    program, *args = shlex.split(command)
    assert program == "gptlab"
    done = subprocess.run(
        [sys.executable, "-m", "gptlab.cli.main", *args],
        cwd=tmp_path,  # the README's relative paths, as a user types them in the project
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.rstrip("\n").split("\n")
    expected = "\n".join(shown).rstrip("\n").split("\n")
    assert len(printed) == len(expected) and all(
        same_line(p, s) for p, s in zip(printed, expected, strict=True)
    ), f"the README shows:\n{chr(10).join(expected)}\nthe command printed:\n{done.stdout}"
    if expected == [""]:  # an empty answer: the README says a warning on stderr says why
        assert done.stderr.startswith("gptlab chat: warning: the model answered nothing")
