"""Writing files so that a crash never leaves a half-written one: atomic paths, JSON, CSV, figures.

Everything is written to a temporary name beside its target and renamed into
place only once complete. A write that fails (a full disk, a read-only or
forbidden folder), also inside a library that wraps the OSError (safetensors),
is a `WriteError`: one line naming the target, and the temporary file is gone.
Temporary names carry the writer's process id, so the next write of the same
target removes those a `kill -9` left behind. No torch here: data preparation
and the metrics check write files too. And `require_file`, for inputs: it tells
a missing file from a folder given in its place.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError, InputError

# The process's umask (reading it means setting it, so set it straight back): the mode new files get.
UMASK = os.umask(0)
os.umask(UMASK)


# What a Rust library (safetensors) keeps of the OSError it met: "... (os error 28)".
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


class WriteError(GptlabError):
    """A file the project could not write (disk full, read-only, forbidden); names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write {path}: {reason}")
        self.path = path
        self.reason = reason

    def moved(self, tmp: Path, final: Path) -> WriteError:
        """The same failure named where the file goes (under `final`), not in the temporary folder `tmp`."""
        where = final / self.path.relative_to(tmp) if self.path.is_relative_to(tmp) else self.path
        return WriteError(where, self.reason)


def wrapped_os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, one it was raised from, or the `(os error N)` its message names."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        if found := _OS_ERROR_CODE.search(str(seen)):
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def naming_write_failures(target: Path) -> Iterator[None]:
    """Within the block, a failed write (an OSError, also wrapped by a library) is a WriteError naming `target`."""
    try:
        yield
    except GptlabError:
        raise
    except Exception as exc:
        cause = wrapped_os_error(exc)
        if cause is None:
            raise
        raise WriteError(target, cause.strerror or str(cause)) from exc


def temp_prefix(target: Path) -> str:
    """The start of a temporary name beside `target`: hidden, and holding this process's id."""
    return f".{target.name}.{os.getpid()}-"


def remove_orphans(target: Path, suffix: str = ".tmp") -> None:
    """Delete the temporary files and folders beside `target` whose writer no longer runs (a kill -9).

    Names without a process id come from writers older than these names; none runs any more.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:(\d+)-)?[A-Za-z0-9_]+{re.escape(suffix)}")
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return  # no folder yet, or none we may list: nothing of ours to clean
    for path in siblings:
        found = pattern.fullmatch(path.name)
        if found is None or (found.group(1) and process_alive(int(found.group(1)))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with suppress(OSError):  # tidying only: a folder we may not change keeps it
                path.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (someone else's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path beside `target` that replaces it only if the block succeeds.

    Any failure to write (in the block too) is a WriteError naming `target`.
    """
    with naming_write_failures(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_orphans(target)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=".tmp", dir=target.parent)
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


def sha256_file(path: Path | str) -> str:
    """Hex sha256 of a file, read in chunks, as sha256sum prints it (params.yaml's pins, model manifests)."""
    with Path(path).open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


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


def require_folder(path: Path, option: str, hint: str = "") -> Path:
    """`path` if it is a folder; else an InputError naming `option` (and `hint`, how to get one)."""
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "no such folder"
        raise InputError(f"{option} {path}: {what}{hint}")
    return path


def project_folder(value: str, key: str) -> Path:
    """Folder `value` of params key `key`, which a stage writes: refused unless inside the project (cwd).

    Read-only, a folder may be anywhere (stage tests read a shared copy of the inputs); written, it
    stays in the project, as DVC tracks it there: an absolute path outside it or one climbing out
    with '..' (a system folder, written as whoever runs the stage) is one line naming the key.
    Checked by name, so a link inside the project to another disk is the way to put data there.
    """
    root = Path.cwd()
    resolved = Path(os.path.normpath(root / value))
    if resolved == root or not resolved.is_relative_to(root):
        raise InputError(
            f"{key} {value!r}: expected a folder inside the project ({root}), as data/raw is: "
            "this stage writes there (for another disk, make that folder a link to it)"
        )
    return Path(value)


@contextmanager
def exclusive_lock(path: Path, holder: str, refusal: Callable[[str], str]) -> Iterator[None]:
    """Hold an OS-level lock (flock) on `path` for the block, with `holder` written in it.

    Held already by another process: a GptlabError, at once, whose text is `refusal` of what that
    holder wrote. The kernel releases the lock when its process dies, however it dies.
    """
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise GptlabError(refusal(fh.read().strip())) from None
        fh.seek(0)
        fh.truncate()
        fh.write(holder)
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
