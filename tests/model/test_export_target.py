"""Where `gptlab export` may write: never into a checkpoint, the source or a non-empty folder unasked;
refused with one line naming the folder, and nothing written or overwritten on the way.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli.main import main
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model, save_model
from gptlab.model.hf_gpt2 import load_hf_folder

from helpers import TINY_GPT, one_line_error, snapshot


def _other_checkpoint(tmp_path: Path, source: Path) -> Path:
    return save_model(build_gpt(TINY_GPT), tmp_path / "models" / "other")


def _non_empty(tmp_path: Path, source: Path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "config.json").write_text('{"mine": true}\n')
    (folder / "todo.txt").write_text("keep me\n")
    return folder


@pytest.mark.parametrize(
    ("target", "force", "message"),
    [
        (lambda tmp, src: src, False, "is the checkpoint being exported"),
        (lambda tmp, src: src, True, "is the checkpoint being exported"),
        (
            lambda tmp, src: tmp / "models" / "pretrain" / ".." / "pretrain",
            True,
            "is the checkpoint being exported",
        ),
        (lambda tmp, src: tmp / "models", True, "holds the checkpoint being exported"),
        (_other_checkpoint, False, "is a gptlab checkpoint"),
        (_other_checkpoint, True, "is a gptlab checkpoint"),
        (_non_empty, False, "is not empty"),
        (lambda tmp, src: (tmp / "file.txt").write_text("x") and tmp / "file.txt", True, "is not a folder"),
    ],
    ids=[
        "source",
        "source-force",
        "source-other-spelling",
        "ancestor-force",
        "checkpoint",
        "checkpoint-force",
        "non-empty",
        "a-file",
    ],
)
def test_export_refuses_and_writes_nothing(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    target: Callable[[Path, Path], Path],
    force: bool,
    message: str,
) -> None:
    out = target(tmp_path, checkpoint)
    before = snapshot(tmp_path)

    argv = ["export", str(checkpoint), str(out)] + (["--force"] if force else [])
    assert main(argv) == 2

    line = one_line_error(capsys, "export")
    assert message in line and str(out) in line
    assert snapshot(tmp_path) == before  # byte-identical, and no temp folder left behind
    load_model(checkpoint)  # still a valid gptlab checkpoint


def _git_clone(tmp_path: Path, source: Path) -> Path:
    """A project as a user clones it, with a note of their own not yet committed."""
    clone = tmp_path / "p5"
    (clone / ".git" / "objects").mkdir(parents=True)
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (clone / "src").mkdir()
    (clone / "src" / "model.py").write_text("print('mine')\n")
    (clone / "MYNOTES.txt").write_text("notes\n")
    return clone


def _export_plus_a_note(tmp_path: Path, source: Path) -> Path:
    out = tmp_path / "hf"
    assert main(["export", str(source), str(out)]) == 0
    (out / "NOTES.txt").write_text("mine\n")
    return out


@pytest.mark.parametrize(
    "target", [_non_empty, _git_clone, _export_plus_a_note], ids=["notes", "git", "export+note"]
)
def test_force_never_replaces_a_folder_export_did_not_make(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], target: Callable[[Path, Path], Path]
) -> None:
    out = target(tmp_path, checkpoint)
    capsys.readouterr()
    before = snapshot(tmp_path)

    assert main(["export", str(checkpoint), str(out), "--force"]) == 2

    line = one_line_error(capsys, "export")
    assert str(out) in line and "not an earlier export" in line
    assert snapshot(tmp_path) == before  # the clone, its .git and the user's note are all still there


def test_force_replaces_an_earlier_export(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert "--force" in one_line_error(capsys, "export")

    assert main(["export", str(checkpoint), str(out), "--force", "--tie-head"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert load_hf_folder(out).cfg.emb_dim == TINY_GPT.emb_dim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "models"]  # no temp or backup folder


def test_export_into_empty_or_new_folder_is_fine(tmp_path: Path, checkpoint: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["export", str(checkpoint), str(tmp_path / "empty")]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "new" / "deeper")]) == 0
    assert snapshot(tmp_path / "empty") == snapshot(tmp_path / "new" / "deeper")


def test_export_failure_midway_leaves_the_old_folder(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 0
    before = snapshot(tmp_path)

    def broken_save(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full, say")

    monkeypatch.setattr("gptlab.model.hf_gpt2.save_file", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["export", str(checkpoint), str(out), "--force"])
    assert snapshot(tmp_path) == before


def test_export_into_unwritable_folder_names_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "hf"
    real_mkdir = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:  # what a read-only folder answers
        if Path(path).parent == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert main(["export", str(checkpoint), str(out)]) == 2
    line = one_line_error(capsys, "export")
    assert str(out) in line and "Permission denied" in line
    assert list(locked.iterdir()) == []


def test_export_into_an_unwritable_place_names_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A parent that is a file cannot hold a folder, whoever runs the test (root ignores chmod 0o555).
    locked = tmp_path / "locked"
    locked.write_text("a file, not a folder")
    assert main(["export", str(checkpoint), str(locked / "hf")]) == 2
    assert str(locked) in one_line_error(capsys, "export")
    assert locked.read_text() == "a file, not a folder"  # nothing written
