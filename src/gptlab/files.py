"""Writing files so that a crash never leaves a half-written one: atomic paths, JSON, CSV, figures.

Everything is written to a temporary name beside its target and renamed into
place only once complete. No torch here: data preparation and the metrics
check write files too. And `require_file`, for inputs: it tells a missing
file from a folder given in its place.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The process's umask (reading it means setting it, so set it straight back): the mode new files get.
UMASK = os.umask(0)
os.umask(UMASK)


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path beside `target` that replaces it only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with tmp_path.open("rb") as fh:
            os.fsync(fh.fileno())
        # mkstemp makes the file private (0600); give it the mode any new file would get.
        os.chmod(tmp_path, 0o666 & ~UMASK)
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_json(path: Path | str, data: Any, *, sort_keys: bool = True, allow_nan: bool = True) -> Path:
    """Write `data` as indented UTF-8 JSON with a trailing newline; returns the path.

    Text stays readable (ensure_ascii=False). `allow_nan=False` makes a nan or inf
    an error instead of the non-standard `NaN`/`Infinity` tokens.
    """
    path = Path(path)
    text = json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False, allow_nan=allow_nan)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    return path


def write_csv(path: Path | str, frame: Any) -> Path:
    """Write a pandas DataFrame as CSV without its index; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)
    return path


def write_figure(path: Path | str, figure: Any, dpi: int = 120) -> Path:
    """Write a matplotlib Figure as PNG; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=dpi)
    return path


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_file(path: Path, kind: str, missing: str) -> Path:
    """`path` if it is a file; IsADirectoryError naming it if a folder, else FileNotFoundError(`missing`)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not {kind}")
    if not path.is_file():
        raise FileNotFoundError(missing)
    return path
