"""Bad inputs, one table per command (issue 14): each is refused with a message naming what is wrong,
the CLI's exit code tells "could not run" (2) from "a check failed" (1), and nothing is written or
overwritten on the way.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gptlab import cli
from gptlab.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model, save_model
from gptlab.config import ModelConfig
from gptlab.hf_gpt2 import load_hf_folder
from gptlab.model import GPTModel

TINY = ModelConfig(vocab_size=300, context_length=32, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=True)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes: equal snapshots, nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The CLI's stderr, checked to be one `gptlab COMMAND: ...` line and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gptlab {command}: "), err
    return lines[0]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return save_model(GPTModel(TINY).eval(), tmp_path / "models" / "pretrain", {"stage": "pretrain"})


# --------------------------------------------------------------------------- #
# 1. gptlab export: never into a checkpoint, the source or a non-empty folder
# --------------------------------------------------------------------------- #


def _other_checkpoint(tmp_path: Path, source: Path) -> Path:
    return save_model(GPTModel(TINY), tmp_path / "models" / "other")


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
    assert cli.main(argv) == 2

    line = one_line_error(capsys, "export")
    assert message in line and str(out) in line
    assert snapshot(tmp_path) == before  # byte-identical, and no temp folder left behind
    load_model(checkpoint)  # still a valid gptlab checkpoint


def test_export_into_non_empty_folder_with_force_replaces_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _non_empty(tmp_path, checkpoint)
    assert cli.main(["export", str(checkpoint), str(out)]) == 2
    assert "--force" in one_line_error(capsys, "export")

    assert cli.main(["export", str(checkpoint), str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert load_hf_folder(out).cfg.emb_dim == TINY.emb_dim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "notes"]  # no temp or backup folder


def test_export_into_empty_or_new_folder_is_fine(tmp_path: Path, checkpoint: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(checkpoint), str(tmp_path / "empty")]) == 0
    assert cli.main(["export", str(checkpoint), str(tmp_path / "new" / "deeper")]) == 0
    assert snapshot(tmp_path / "empty") == snapshot(tmp_path / "new" / "deeper")


def test_export_failure_midway_leaves_the_old_folder(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _non_empty(tmp_path, checkpoint)
    before = snapshot(tmp_path)

    def broken_save(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full, say")

    monkeypatch.setattr("gptlab.hf_gpt2.save_file", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        cli.main(["export", str(checkpoint), str(out), "--force"])
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
    assert cli.main(["export", str(checkpoint), str(out)]) == 2
    line = one_line_error(capsys, "export")
    assert str(out) in line and "Permission denied" in line
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_export_into_read_only_folder_names_it(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert cli.main(["export", str(checkpoint), str(locked / "hf")]) == 2
    finally:
        locked.chmod(0o755)
    assert str(locked / "hf") in one_line_error(capsys, "export")
