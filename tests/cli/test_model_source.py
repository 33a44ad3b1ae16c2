"""`--model models:/...`: a look-up in the tracking store reads it and never creates one."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptlab.cli.main import main

from helpers import one_line_error


@pytest.mark.parametrize("command", [["classify", "hi"], ["chat", "Name a color."]])
def test_a_model_uri_with_no_store_is_one_line_and_creates_no_store(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no project here: the default store would be ./mlflow.db
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert main([*command, "--model", "models:/gptlab-spam@champion"]) == 2
    line = one_line_error(capsys, command[0])
    assert "models:/gptlab-spam@champion: no such model" in line and str(tmp_path / "mlflow.db") in line
    assert list(tmp_path.iterdir()) == []
