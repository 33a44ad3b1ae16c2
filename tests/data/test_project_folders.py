"""The folders the stages write stay in the project (issue 65, item 18): data.raw_dir set to a system
folder was accepted, and the download wrote there as whoever ran it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gptlab.errors import InputError
from gptlab.files import project_folder
from stages import tokenize_data

from helpers import PROJECT_ROOT, committed_params, committed_params_raw


def test_a_written_folder_outside_the_project_is_refused_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for inside in ("data/raw", "data/../inputs/raw", str(tmp_path / "data" / "raw")):
        assert project_folder(inside, "data.raw_dir") == Path(inside)
    for outside in ("/etc/gptlab", "../elsewhere", "data/../..", ".", str(tmp_path.parent / "raw")):
        with pytest.raises(
            InputError, match=f"^data.raw_dir '{outside}': expected a folder inside the project"
        ):
            project_folder(outside, "data.raw_dir")


def test_download_stage_refuses_a_raw_dir_outside_the_project_in_one_line(tmp_path: Path) -> None:
    outside = tmp_path / "system" / "raw"
    params = committed_params_raw()
    params["data"]["raw_dir"] = str(outside)
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-P", str(PROJECT_ROOT / "stages" / "download.py"), "--params", "params.yaml"],
        cwd=project,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: data.raw_dir '{outside}': expected a folder inside the project ({project}), as data/raw is: "
        "this stage writes there (for another disk, make that folder a link to it)"
    ]
    assert not (tmp_path / "system").exists()  # nothing written there


def test_tokenize_refuses_a_processed_dir_outside_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = committed_params()
    data = dataclasses.replace(params.data, processed_dir="../processed")
    with pytest.raises(InputError, match="^data.processed_dir '../processed': expected a folder inside"):
        tokenize_data.run(dataclasses.replace(params, data=data))
    assert not (tmp_path.parent / "processed").exists()
