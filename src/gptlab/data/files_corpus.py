"""The user's own files as one source of documents for corpus_shards (corpus.name files).

.txt and .md files are one document each; .jsonl, .jsonl.gz and .parquet files one document
per row (its corpus.files.text_field), read a line or a batch of rows at a time. Every file is
read twice: once to check it all (`scan_files`, before anything is written, so a bad file is one
line naming it and its line or row, with nothing half-written and no training on garbage), then
to tokenize (`tokenize_files`). Memory is one document and one file's summary per file.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiktoken

from gptlab.data.config import FilesCorpus
from gptlab.data.corpus_shards import Document, staged_dir, tokenize_documents
from gptlab.errors import InputError
from gptlab.files import write_json

TEXT_SUFFIXES = (".txt", ".md")
ROW_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
DOCUMENTS_REPORT = "documents.json"
_PARQUET_BATCH_ROWS = 1024


@dataclass
class FileSummary:
    """One file as the check found it: its documents kept and dropped, bytes and sha256."""

    file: str  # relative to the project
    documents: int = 0
    dropped_empty: int = 0
    dropped_short: int = 0
    bytes: int = 0
    sha256: str = ""


@dataclass
class FilesScan:
    """What `scan_files` found: the files in order, with their summaries; the corpus's digest."""

    cfg: FilesCorpus
    files: list[Path]
    summaries: list[FileSummary] = field(default_factory=list)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.summaries)

    def digest(self) -> str:
        """sha256 naming the corpus's exact content: each file's name and sha256, in order."""
        rows = "".join(f"{s.file}\t{s.sha256}\n" for s in self.summaries)
        return hashlib.sha256(rows.encode()).hexdigest()


def find_files(cfg: FilesCorpus) -> list[Path]:
    """The corpus's files, sorted by path: a path outside the project or no file at all is one line.

    The project is the working folder (stages run at its root); hidden files and folders are skipped.
    """
    project = Path.cwd().resolve()
    where = Path(cfg.path)
    try:
        where.resolve().relative_to(project)  # symbolic links followed: DVC tracks what lies inside
    except ValueError:
        raise InputError(
            f"corpus.files.path {cfg.path!r}: outside the project ({project}), where DVC cannot track "
            "it: copy or move the files into the project (e.g. data/own/; `dvc add data/own` keeps large "
            "data out of git) and set corpus.files.path to that folder"
        ) from None
    if not where.exists():
        raise InputError(f"corpus.files.path {cfg.path!r}: not found in {project}")
    candidates = [where] if where.is_file() else sorted(where.glob(cfg.glob or "**/*"), key=Path.as_posix)
    files = [
        p
        for p in candidates
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(where).parts)
    ]
    if cfg.glob is None and where.is_dir():
        files = [p for p in files if _suffix(p) is not None]
    for path in files:
        if _suffix(path) is None:
            raise InputError(
                f"{path}: not a corpus file; expected {', '.join(TEXT_SUFFIXES + ROW_SUFFIXES)} "
                "(narrow corpus.files.glob)"
            )
    if not files:
        pattern = f" matching {cfg.glob!r}" if cfg.glob else ""
        raise InputError(
            f"corpus.files.path {cfg.path!r}: no {', '.join(TEXT_SUFFIXES + ROW_SUFFIXES)} file{pattern} "
            "found: an empty corpus"
        )
    return files


def scan_files(cfg: FilesCorpus) -> FilesScan:
    """Every file read and checked, documents counted, before anything is written."""
    scan = FilesScan(cfg, find_files(cfg))
    for path in scan.files:
        summary = FileSummary(path.as_posix(), bytes=path.stat().st_size)
        digest = hashlib.sha256()
        for text in _raw_documents(path, cfg, digest):
            kept = _clean(text, cfg)
            if kept is None:
                if text.strip():
                    summary.dropped_short += 1
                else:
                    summary.dropped_empty += 1
            else:
                summary.documents += 1
        summary.sha256 = digest.hexdigest()
        scan.summaries.append(summary)
    if scan.documents < 2:
        dropped = sum(s.dropped_empty + s.dropped_short for s in scan.summaries)
        why = (
            f" ({dropped} dropped by cleaning: blank, or shorter than corpus.files.min_chars={cfg.min_chars})"
            if dropped
            else ""
        )
        raise InputError(
            f"corpus.files.path {cfg.path!r}: {scan.documents} document(s) left after cleaning{why}; "
            "at least 2 are needed (one to train on, one to validate on)"
        )
    return scan


def tokenize_files(scan: FilesScan, out_dir: Path, tokenizer: tiktoken.Encoding) -> dict[str, Any]:
    """`out_dir`/{train,val}-NNNNN.bin and documents.json from a checked corpus; returns the counts."""
    cfg = scan.cfg
    digest = scan.digest()
    with staged_dir(out_dir) as tmp:
        shards = tokenize_documents(
            _documents(scan),
            scan.documents,
            tmp,
            tokenizer,
            val_every=cfg.val_every,
            shard_tokens=cfg.shard_tokens,
            total_bytes=sum(s.bytes for s in scan.summaries),
        )
        summaries = [vars(s) for s in scan.summaries]
        write_json(tmp / DOCUMENTS_REPORT, {"content_sha256": digest, "files": summaries}, sort_keys=False)
    return {
        "files": len(scan.files),
        "documents": scan.documents,
        "dropped_empty": sum(s.dropped_empty for s in scan.summaries),
        "dropped_short": sum(s.dropped_short for s in scan.summaries),
        "bytes": sum(s.bytes for s in scan.summaries),
        "tokens": sum(shards.tokens.values()),
        "content_sha256": digest,
    } | shards.counts()


def _documents(scan: FilesScan) -> Iterator[Document]:
    """The kept documents, in file order; each file's bytes counted once, on its first document."""
    for path, summary in zip(scan.files, scan.summaries, strict=True):
        size = summary.bytes
        for text in _raw_documents(path, scan.cfg, hashlib.sha256()):
            kept = _clean(text, scan.cfg)
            if kept is not None:
                yield Document(kept, size)
                size = 0


def _clean(text: str, cfg: FilesCorpus) -> str | None:
    """The document as trained on, or None when cleaning drops it."""
    if cfg.normalize_newlines:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    length = len(text.strip())
    if (cfg.drop_empty and length == 0) or length < cfg.min_chars:
        return None
    return text


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in TEXT_SUFFIXES + ROW_SUFFIXES if name.endswith(s)), None)


def _raw_documents(path: Path, cfg: FilesCorpus, digest: Any) -> Iterator[str]:
    """The documents of one file as written, its bytes fed to `digest` as they are read."""
    suffix = _suffix(path)
    if suffix in TEXT_SUFFIXES:
        data = path.read_bytes()
        digest.update(data)
        yield _decode(data, cfg.encoding, str(path))
    elif suffix == ".parquet":
        with path.open("rb") as fh:  # hashed a chunk at a time: a Parquet file may be large
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        yield from _parquet_rows(path, cfg.text_field)
    else:
        yield from _jsonl_rows(path, cfg, digest)


def _decode(data: bytes, encoding: str, where: str) -> str:
    """`data` as text; a NUL byte (a binary file) or bytes not in `encoding` are one line naming the place."""
    nul = data.find(b"\x00")
    if nul != -1 and not codecs.lookup(encoding).name.startswith(("utf-16", "utf-32")):  # theirs hold NULs
        line = data.count(b"\n", 0, nul) + 1
        raise InputError(
            f"{where}: a binary file, not text (a NUL byte at line {line}): remove it from "
            "corpus.files.path or narrow corpus.files.glob"
        )
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            f"{where}, line {line}: not {encoding} (byte {exc.start}); set corpus.files.encoding to the "
            "file's encoding (e.g. latin-1, cp1252) or convert it to UTF-8"
        ) from None
    return text.removeprefix("\ufeff")  # a byte order mark is no text


def _jsonl_rows(path: Path, cfg: FilesCorpus, digest: Any) -> Iterator[str]:
    """Each JSON line's text field, a line at a time (gzip-compressed when the name ends .gz)."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            for number, line in enumerate(fh, start=1):
                digest.update(line)
                where = f"{path}, line {number}"
                text = _decode(line, cfg.encoding, where)
                if not text.strip():
                    continue  # a blank line is no row
                try:
                    row = json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise InputError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
                yield _text_field(row, cfg.text_field, where)
    except (gzip.BadGzipFile, EOFError) as exc:
        raise InputError(f"{path}: not a readable gzip file ({exc})") from None


def _text_field(row: Any, field_name: str, where: str) -> str:
    if not isinstance(row, dict):
        raise InputError(
            f"{where}: expected a JSON object with a {field_name!r} field, got {type(row).__name__}"
        )
    if field_name not in row:
        keys = ", ".join(sorted(row)[:10]) or "none"
        raise InputError(
            f"{where}: no {field_name!r} field (it has: {keys}); set corpus.files.text_field to the text's field"
        )
    value = row[field_name]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"{where}: field {field_name!r} is a {type(value).__name__}, expected a string")
    return value


def _parquet_rows(path: Path, field_name: str) -> Iterator[str]:
    """The text column of a Parquet file, a batch of rows at a time (nulls as empty documents)."""
    # only a corpus with Parquet files pays for pyarrow's import
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    names = reader.schema_arrow.names
    if field_name not in names:
        raise InputError(
            f"{path}: no column {field_name!r} (it has: {', '.join(names[:10])}); "
            "set corpus.files.text_field to the text's column"
        )
    kind = reader.schema_arrow.field(field_name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise InputError(f"{path}: column {field_name!r} holds {kind}, expected strings")
    for batch in reader.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field_name]):
        for value in batch.column(0).to_pylist():
            yield value or ""
