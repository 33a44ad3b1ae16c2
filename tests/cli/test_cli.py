"""The CLI's contract: help without heavy imports, one line and exit code 2 for expected failures."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gptlab.cli.main import COMMANDS, main
from gptlab.errors import GptlabError, InputError, describe_failure
from gptlab.experiments.sweep import sweep_path
from gptlab.model.checkpoint import WEIGHTS_FILE

from helpers import PROJECT_ROOT, one_line_error

HEAVY = ("torch", "gptlab.model.gpt", "mlflow")


COMMAND_NAMES = sorted(COMMANDS)
STAGE_SCRIPTS = sorted(Path(__file__).resolve().parents[2].glob("stages/*.py"))


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in COMMAND_NAMES)])
def test_help_imports_no_torch(args: list[str]) -> None:
    code = (
        "import sys\n"
        f"sys.argv = ['gptlab', *{args!r}]\n"
        "from gptlab.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]", out


@pytest.mark.parametrize("script", STAGE_SCRIPTS, ids=lambda path: path.name)
def test_a_stage_script_answers_help_before_its_heavy_imports(script: Path) -> None:
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(script)!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print('exit', exit.code)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"usage: {script.name} [-h] [--params PARAMS]"), out
    assert out.splitlines()[-2:] == ["exit 0", "[]"], out


def test_expected_failures_are_one_line_and_bugs_keep_their_traceback() -> None:
    assert describe_failure(InputError("spam.lr: expected a float")) == "spam.lr: expected a float"
    missing = FileNotFoundError(2, "No such file or directory", "reports/x.json")
    assert describe_failure(missing) == "reports/x.json: No such file or directory"
    assert describe_failure(KeyError("bug")) is None
    assert issubclass(InputError, GptlabError) and issubclass(InputError, ValueError)


def test_a_missing_file_is_exit_code_2_naming_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["export", str(tmp_path / "no-such-checkpoint"), str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-checkpoint" in err and "Traceback" not in err


def test_version_names_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gptlab {importlib.metadata.version('gptlab')}"


def test_version_from_a_source_tree_that_is_not_installed(tmp_path: Path) -> None:
    """`python -m gptlab.cli.main` with PYTHONPATH=src and no installed package (as benchmarks/gpu.sh runs)."""
    import yaml

    libs = tmp_path / "libs"  # the package and PyYAML alone: no metadata of an install on the path
    shutil.copytree(PROJECT_ROOT / "src" / "gptlab", libs / "gptlab")
    (libs / "yaml").symlink_to(Path(yaml.__file__).parent)
    done = subprocess.run(
        [sys.executable, "-S", "-m", "gptlab.cli.main", "--version"],
        env={**os.environ, "PYTHONPATH": str(libs)},  # -S: no site-packages
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gptlab (not installed: running from a source tree)"


def test_a_folder_given_for_a_file_is_named_as_a_folder(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "messages"
    folder.mkdir()
    assert main(["classify", "--file", str(folder), "--model", str(checkpoint)]) == 2
    assert (
        one_line_error(capsys, "classify") == f"gptlab classify: --file {folder}: is a directory, not a file"
    )
    weights = checkpoint / WEIGHTS_FILE
    assert main(["chat", "--model", str(weights), "Say hi"]) == 2
    assert one_line_error(capsys, "chat").startswith(
        f"gptlab chat: --model {weights}: is a file, not a checkpoint"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    assert main(["run", "--profile", str(folder)]) == 2
    assert one_line_error(capsys, "run") == f"gptlab run: profile {folder}: is a directory, not a file"
    with pytest.raises(
        IsADirectoryError, match=re.escape(f"sweep file {folder}: is a directory, not a file")
    ):
        sweep_path(folder)
    assert main(["metrics", "check", "--baseline", str(folder)]) == 2
    assert (
        one_line_error(capsys, "metrics")
        == f"gptlab metrics: baseline {folder}: is a directory, not a baseline file"
    )


@pytest.mark.parametrize("command", ["classify", "chat"])
def test_device_is_auto_unless_given_and_an_unavailable_one_names_the_flag(
    command: str, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch  # only this test needs it: which device is missing here

    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert re.search(r"--device .*\(default:\s+auto\)", " ".join(capsys.readouterr().out.split()))
    missing = "mps" if torch.cuda.is_available() else "cuda"  # no machine has both
    assert main([command, "Hi", "--model", str(checkpoint), "--device", missing]) == 2
    assert one_line_error(capsys, command).startswith(f"gptlab {command}: --device: {missing} was requested")


def test_the_top_help_says_which_command_runs_the_pipeline_when(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for command in ("gptlab smoke", "dvc repro", "gptlab run", "gptlab sweep"):
        (line,) = [line for line in lines if line.strip().startswith(command)]
        assert len(line.split(command, 1)[1].strip()) > 20, line  # each with what it is for


@pytest.mark.parametrize(
    "argv", [["report", "--bogus"], ["chat", "--bogus", "x"], ["run", "--profile", "p", "-x"]]
)
def test_a_bad_option_to_a_sub_command_shows_that_sub_commands_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: gptlab {argv[0]} [-h]"), err
    assert err.rstrip().endswith(
        f"gptlab {argv[0]}: error: unrecognized arguments: {argv[-2] if argv[0] == 'chat' else argv[-1]}"
    ), err
