"""Fetch pinned external files: verified by sha256, written atomically, offline-friendly.

Each file is resolved in this order: already at its destination with the right
hash -> a mirror folder (GPTLAB_MIRROR: each file at its pinned path under it,
as `gptlab mirror DIR` writes one) -> its URL (GPTLAB_URL_REWRITE: sent to an HTTP
mirror of the URLs instead, e.g. a company proxy or a test's local server).
Bytes are hashed while they are copied into a temporary file beside the
destination, and only a verified file is renamed into place, so a failure
never leaves a partial or unverified file behind. `fetch_local` stops before the
URL, for files another client downloads (GPT-2's weights: see hub_weights.py).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import secrets
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO, Literal

from tqdm import tqdm

from gptlab.errors import GptlabError, InputError
from gptlab.files import naming_write_failures, remove_orphans, sha256_file, temp_prefix

MIRROR_ENV = "GPTLAB_MIRROR"
# "PREFIX=REPLACEMENT ...": a URL starting with PREFIX is fetched from REPLACEMENT + the rest, still
# verified by its sha256 (e.g. https://=http://proxy.local/ serves https://host/path at /host/path).
URL_REWRITE_ENV = "GPTLAB_URL_REWRITE"
_CHUNK = 1 << 20
# Seconds a stalled connection may stay silent before the download fails.
_TIMEOUT_S = 60
_USER_AGENT = "gptlab (urllib)"

Origin = Literal["present", "mirror", "url", "huggingface"]


class FetchError(GptlabError):
    """A pinned file that could not be obtained or did not verify; the message says how to supply it."""


@dataclass(frozen=True)
class Fetched:
    """A verified file and where it came from."""

    path: Path
    origin: Origin
    size: int


def mirror_dir() -> Path | None:
    """The mirror folder named by GPTLAB_MIRROR, or None when unset."""
    value = os.environ.get(MIRROR_ENV)
    return Path(value).expanduser() if value else None


def rewritten_url(url: str) -> str:
    """`url` as GPTLAB_URL_REWRITE sends it: the first matching prefix replaced, else unchanged."""
    for rule in os.environ.get(URL_REWRITE_ENV, "").split():
        prefix, sep, replacement = rule.partition("=")
        if not sep or not prefix:
            raise InputError(f"{URL_REWRITE_ENV} rule {rule!r}: expected PREFIX=REPLACEMENT")
        if url.startswith(prefix):
            return replacement + url[len(prefix) :]
    return url


def safe_relative_path(name: str, what: str) -> PurePosixPath:
    """`name` as a relative path that stays inside its folder; ValueError otherwise."""
    posix = PurePosixPath(name.replace("\\", "/"))
    if (
        not name
        or posix.is_absolute()
        or PureWindowsPath(name).drive
        or any(part in ("..", "") for part in posix.parts)
    ):
        raise InputError(
            f"{what} {name!r}: expected a relative path without '..' that stays inside its folder"
        )
    return posix


def fetch(
    dest: Path,
    *,
    url: str,
    sha256: str,
    mirror_file: Path | None = None,
    member: str | None = None,
    size: int | None = None,
    progress: bool = True,
) -> Fetched:
    """Make sure `dest` holds the file pinned by `sha256` (and `size`), and say where it came from.

    `member` names the one file to extract when `url` serves a zip archive
    (mirrors hold the extracted file); `progress` shows the download's own bar (off where
    a caller fetches many files under one). Raises FetchError when no source works.
    """
    dest = Path(dest)
    pin = _Pin(dest, url, sha256.lower(), size, mirror_file)
    if member is not None:
        try:
            safe_relative_path(member, "zip member")
        except ValueError as exc:
            raise pin.error(f"refused: {exc}") from None

    local = pin.from_disk()
    if local is not None:
        return local
    try:
        _download(pin, member, progress)
    except (OSError, ValueError, http.client.HTTPException, zipfile.BadZipFile, zlib.error) as exc:
        raise pin.error(f"download failed: {type(exc).__name__}: {exc}") from exc
    return Fetched(dest, "url", dest.stat().st_size)


def fetch_local(
    dest: Path, *, url: str, sha256: str, mirror_file: Path | None = None, size: int | None = None
) -> Fetched | None:
    """`fetch` without its download: `dest` if it verifies, else a verified copy of `mirror_file`.

    None when neither holds the file; `url` is only named in errors. Raises
    FetchError when a file is there but does not match its pin.
    """
    return _Pin(Path(dest), url, sha256.lower(), size, mirror_file).from_disk()


@dataclass(frozen=True)
class _Pin:
    """What a file must be, and how to tell the user when it is not."""

    dest: Path
    url: str
    sha256: str
    size: int | None
    mirror_file: Path | None

    def check_present(self) -> Fetched | None:
        if not self.dest.exists():
            return None
        if not self.dest.is_file():
            raise self.error(f"{self.dest} exists but is not a regular file; remove it")
        actual_size = self.dest.stat().st_size
        # A wrong size settles it without hashing (weights files are hundreds of MB).
        if (self.size is None or actual_size == self.size) and sha256_file(self.dest) == self.sha256:
            return Fetched(self.dest, "present", actual_size)
        return None  # stale or damaged: replaced below, once a verified copy exists

    def from_disk(self) -> Fetched | None:
        """`dest` if it verifies, else a verified copy of the mirror file; None when neither is there."""
        remove_orphans(self.dest, suffix=".part")  # what a killed fetch of `dest` left
        present = self.check_present()
        if present is not None:
            return present
        if self.mirror_file is None or not self.mirror_file.is_file():
            return None
        with self.mirror_file.open("rb") as src:
            self.publish(src, f"mirror file {self.mirror_file}")
        return Fetched(self.dest, "mirror", self.dest.stat().st_size)

    @contextmanager
    def temp_file(self) -> Iterator[Path]:
        """A hidden temporary file beside `dest`, removed whatever happens.

        A failed write is a WriteError naming `dest`.
        """
        with naming_write_failures(self.dest):
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.dest.parent / f"{temp_prefix(self.dest)}{secrets.token_hex(6)}.part"
            # Not mkstemp: its 0600 mode would survive the rename; this honours the umask.
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            try:
                yield tmp
            finally:
                tmp.unlink(missing_ok=True)

    def publish(self, src: BinaryIO, origin: str, total: int | None = None, progress: bool = False) -> None:
        """Copy `src` beside `dest`, verify it, then rename it into place."""
        with self.temp_file() as tmp:
            # Reading one byte past a pinned size is enough to refuse an oversized stream.
            limit = None if self.size is None else self.size + 1
            with tmp.open("wb") as out:
                actual, written = _copy(
                    src, out, desc=self.dest.name, total=total, progress=progress, limit=limit
                )
            if actual != self.sha256 or (self.size is not None and written != self.size):
                raise self.error(f"{origin} does not match its pin ({written:,} bytes read)", actual=actual)
            os.replace(tmp, self.dest)

    def _via(self) -> str:
        """Where GPTLAB_URL_REWRITE sent the download, when it did."""
        try:
            sent = rewritten_url(self.url)
        except InputError:
            return f" ({URL_REWRITE_ENV} malformed)"
        return "" if sent == self.url else f" (fetched from {sent}, per {URL_REWRITE_ENV})"

    def error(self, reason: str, actual: str | None = None) -> FetchError:
        if self.mirror_file is None:
            mirror = f"not used ({MIRROR_ENV} is not set)"
        elif self.mirror_file.is_file():
            mirror = str(self.mirror_file)
        else:
            mirror = f"{self.mirror_file} (not found)"
        expected_size = f" ({self.size:,} bytes)" if self.size is not None else ""
        # A stale file at dest is kept until a verified copy replaces it; say what it is.
        at_dest = f"sha256 {sha256_file(self.dest)}" if self.dest.is_file() else "nothing"
        lines = [
            f"could not fetch {self.dest}: {reason}",
            f"  url:             {self.url}{self._via()}",
            f"  mirror:          {mirror}",
            f"  at destination:  {at_dest}",
            f"  expected sha256: {self.sha256}{expected_size}",
            f"  actual sha256:   {actual or 'none (nothing complete to hash)'}",
            f"To supply it offline, set {MIRROR_ENV} to a folder of the pinned files"
            + (f" (this one at {self.mirror_file})" if self.mirror_file else "")
            + " such as `gptlab mirror DIR` writes on a machine with internet,"
            + f" or put the file with that sha256 at {self.dest}.",
        ]
        return FetchError("\n".join(lines))


def _copy(
    src: BinaryIO,
    out: BinaryIO,
    *,
    desc: str,
    total: int | None = None,
    progress: bool = False,
    limit: int | None = None,
) -> tuple[str, int]:
    """Copy `src` to `out` in chunks, hashing as it goes; returns (sha256, bytes copied).

    `total` is the announced length (a shorter stream is an error), `limit` the
    most bytes to read.
    """
    digest = hashlib.sha256()
    written = 0
    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress
    ) as bar:
        while chunk := src.read(_CHUNK if limit is None else min(_CHUNK, limit - written)):
            digest.update(chunk)
            out.write(chunk)
            written += len(chunk)
            bar.update(len(chunk))
    # urllib returns a short body without complaint when the server hangs up early.
    if total is not None and written < total and (limit is None or written < limit):
        raise http.client.IncompleteRead(b"", total - written)
    out.flush()
    os.fsync(out.fileno())
    return digest.hexdigest(), written


def _download(pin: _Pin, member: str | None, progress: bool) -> None:
    """Download `pin.url` with a progress bar; from a zip, extract only `member`."""
    request = urllib.request.Request(rewritten_url(pin.url), headers={"User-Agent": _USER_AGENT})
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        if member is None:
            pin.publish(response, f"the download from {pin.url}", total=total, progress=progress)
            return
        # The archive itself is scratch: kept beside dest only until the member is out.
        with pin.temp_file() as archive:
            with archive.open("wb") as out:
                name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlsplit(pin.url).path)).name
                _copy(response, out, desc=name, total=total, progress=progress)
            _extract_member(pin, archive, member)


def _extract_member(pin: _Pin, archive: Path, member: str) -> None:
    """Stream one named member out of `archive` into `pin.dest`, never using the zip's paths."""
    with zipfile.ZipFile(archive) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            names = ", ".join(sorted(zf.namelist())[:20])
            raise pin.error(f"the archive has no member {member!r} (it has: {names})") from None
        if info.is_dir():
            raise pin.error(f"archive member {member!r} is a directory, not a file")
        with zf.open(info) as src:
            pin.publish(src, f"member {member!r} of {pin.url}")
