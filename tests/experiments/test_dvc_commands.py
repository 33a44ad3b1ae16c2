"""dvc commands: a read-only one that stalls (no CPU) is stopped and asked again; a slow one that works is not."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from gptlab.errors import GptlabError
from gptlab.experiments.dvc_commands import Dvc, QueueStatus, ask_dvc, run_dvc
from gptlab.experiments.profiles import dvc_executable

from helpers import dvc, git


def fake_dvc(folder: Path, body: str) -> str:
    """An executable named dvc whose Python body runs with the command's arguments in sys.argv."""
    path = folder / "dvc"
    path.write_text(f"#!{sys.executable}\nimport sys, time\nfrom pathlib import Path\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_query_that_stalls_once_is_asked_again_and_answers(tmp_path: Path) -> None:
    # Its first call waits for good without using CPU, as `dvc exp show` does on pygit2's lost wake-up.
    stalls_once = fake_dvc(
        tmp_path,
        "calls = Path(sys.argv[0]).with_name('calls')\n"
        "calls.write_text(calls.read_text() + 'x' if calls.exists() else 'x')\n"
        "if len(calls.read_text()) == 1:\n    time.sleep(600)\n"
        "print('[]')",
    )
    started = time.monotonic()
    answer = ask_dvc(stalls_once, ["exp", "show", "--json"], cwd=tmp_path, stall_after=1)
    assert answer.code == 0 and answer.stdout == "[]\n"
    assert (tmp_path / "calls").read_text() == "xx"
    assert time.monotonic() - started < 60  # the stall bound, not the 5-minute call bound


def test_a_query_that_always_stalls_fails_naming_it(tmp_path: Path) -> None:
    (calls := tmp_path / "calls").write_text("")
    stalls = fake_dvc(tmp_path, f"Path({str(calls)!r}).open('a').write('x')\ntime.sleep(600)")
    with pytest.raises(GptlabError) as failed:
        ask_dvc(stalls, ["exp", "show", "--json"], cwd=tmp_path, stall_after=1, attempts=2)
    assert (
        str(failed.value) == "`dvc exp show --json ...` used no CPU for 1 s and was stopped, 2 times in a row"
    )
    assert calls.read_text() == "xx"


def test_a_slow_query_that_works_is_not_stopped(tmp_path: Path) -> None:
    busy = fake_dvc(
        tmp_path, "end = time.process_time() + 4\nwhile time.process_time() < end:\n    pass\nprint('done')"
    )
    answer = ask_dvc(busy, ["exp", "show"], cwd=tmp_path, stall_after=1, attempts=1)
    assert answer.stdout == "done\n"


def test_a_command_that_changes_the_project_is_never_asked_twice(tmp_path: Path) -> None:
    (calls := tmp_path / "calls").write_text("")
    waits = fake_dvc(tmp_path, f"Path({str(calls)!r}).open('a').write('x')\ntime.sleep(600)")
    with pytest.raises(GptlabError, match=r"`dvc queue start --jobs \.\.\.` did not finish within 2 s"):
        run_dvc(waits, ["queue", "start", "--jobs", "2"], cwd=tmp_path, timeout=2)
    assert calls.read_text() == "x"


@pytest.mark.slow
def test_queue_status_reads_dvcs_own_table(tmp_path: Path) -> None:
    """The real dvc: a queued experiment by name, and no worker."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text("lr: 1\n")
    (project / "dvc.yaml").write_text("stages:\n  train:\n    cmd: echo trained\n    params: [lr]\n")
    git(project, "init", "-q")
    dvc(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "a stage")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    dvc(project, "exp", "run", "--queue", "--name", "tiny-a", "-S", "lr=2", env=env)
    dvc(project, "exp", "run", "--queue", "--name", "tiny-b", "-S", "lr=3", env=env)
    assert Dvc(project, env, dvc_executable()).queue_status() == QueueStatus(
        {"tiny-a": "queued", "tiny-b": "queued"}, (0, 0)
    )
