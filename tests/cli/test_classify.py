"""`gptlab classify` reads messages from arguments, a file or stdin, and names a line that is not UTF-8."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gptlab.cli.classify import _read_texts
from gptlab.cli.main import main

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
