"""`gptlab classify` reads messages from arguments, a file, a pipe or stdin, and names a line that is not UTF-8."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gptlab.cli.classify import _read_texts
from gptlab.cli.main import main
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import save_model
from gptlab.model.config import ModelConfig
from gptlab.tasks.classifier import make_classifier

from helpers import one_line_error


@pytest.mark.parametrize("via_stdin", [False, True], ids=["file", "stdin"])
def test_classify_non_utf8_file_names_file_and_line(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    via_stdin: bool,
) -> None:
    messages = tmp_path / "messages.txt"
    messages.write_bytes("hello there\n\nfree prize\nvoil\xe0 une offre\n".encode("latin-1"))
    if via_stdin:

        class Stdin:
            buffer = io.BytesIO(messages.read_bytes())

        monkeypatch.setattr("sys.stdin", Stdin)
    source = "-" if via_stdin else str(messages)
    assert main(["classify", "--file", source, "--model", str(checkpoint)]) == 2
    line = one_line_error(capsys, "classify")
    assert ("<stdin>" if via_stdin else str(messages)) in line
    assert "line 4" in line and "UTF-8" in line


def test_classify_reads_utf8_lines_from_a_file_or_stdin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = tmp_path / "messages.txt"
    messages.write_text("voilà\r\n\nfree prize 😀\n", encoding="utf-8")
    assert _read_texts(["first"], str(messages)) == ["first", "voilà", "free prize 😀"]
    monkeypatch.setattr("sys.stdin", io.StringIO("from a text stream\n"))  # no .buffer: already text
    assert _read_texts([], "-") == ["from a text stream"]


def test_classify_reads_a_pipe_and_a_fifo_as_files(tmp_path: Path) -> None:
    """`--file <(command)` names a pipe (/dev/fd/N); a FIFO is one with a name: both are read to their end."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as writer:
        writer.write(b"from a pipe\n\nsecond line\n")
    try:
        assert _read_texts([], f"/dev/fd/{read_end}") == ["from a pipe", "second line"]
    finally:
        os.close(read_end)

    fifo = tmp_path / "messages.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=("through a fifo\n",), daemon=True)
    writer.start()
    assert _read_texts(["first"], str(fifo)) == ["first", "through a fifo"]
    writer.join(timeout=10)
    with pytest.raises(FileNotFoundError, match="--file .*gone: no such file"):
        _read_texts([], str(tmp_path / "gone"))


@pytest.mark.slow
def test_classify_reads_process_substitution_dev_stdin_and_dash_in_a_real_shell(
    tmp_path: Path, shared_data: Path
) -> None:
    """As a user types it, in bash: `--file <(echo ...)`, `... | --file /dev/stdin` and `... | --file -`."""
    torch.manual_seed(0)
    cfg = ModelConfig(context_length=32, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.0)
    model = make_classifier(build_gpt(cfg), 2, trainable="head", trainable_blocks=1, seed=123).eval()
    save_model(
        model, tmp_path / "clf", {"labels": {"0": "ham", "1": "spam"}, "max_length": 12, "pooling": "last"}
    )
    gptlab = f"{shlex.quote(sys.executable)} -m gptlab.cli.main classify --json --model {tmp_path / 'clf'} --raw-dir {shared_data}"
    script = "\n".join(
        [
            "set -e",
            f"{gptlab} --file <(printf 'win a prize\\nsee you soon\\n')",
            f"printf 'win a prize\\nsee you soon\\n' | {gptlab} --file /dev/stdin",
            f"printf 'win a prize\\nsee you soon\\n' | {gptlab} --file -",
        ]
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["text"] for row in rows] == ["win a prize", "see you soon"] * 3
    assert rows[:2] == rows[2:4] == rows[4:]


def test_classify_refuses_a_line_of_nuls_as_an_empty_message(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = tmp_path / "messages.txt"
    messages.write_bytes(b"hello there\n\x00\x00\x00\n")
    assert main(["classify", "--file", str(messages), "--model", str(checkpoint)]) == 2
    line = one_line_error(capsys, "classify")
    assert "message 2 is empty (only control characters: '\\x00\\x00\\x00')" in line, line


def test_classify_escapes_control_characters_in_its_plain_output() -> None:
    from gptlab.cli.classify import _shown

    # A right-to-left override would print "free prize" reversed; an escape code would colour the terminal.
    assert _shown("win \u202eezirp eerf\x1b[31m now") == "win \\u202eezirp eerf\\x1b[31m now"
    assert _shown("voilà 😀\tok") == "voilà 😀 ok"  # printable text stays as it is
