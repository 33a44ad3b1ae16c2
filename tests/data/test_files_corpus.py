"""The user's own files as a corpus: each input kind, the cleaning knobs, the split, and each bad input."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gptlab.data.config import FilesCorpus
from gptlab.data.files_corpus import DOCUMENTS_REPORT, scan_files, tokenize_files
from gptlab.data.token_shards import read_shard, shard_paths
from gptlab.errors import InputError
from gptlab.schema import ConfigError

from helpers import committed_params

DEFAULTS = dataclasses.replace(committed_params().corpus.files, path="texts")


def corpus(**changes) -> FilesCorpus:
    return dataclasses.replace(DEFAULTS, **changes)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project folder, the working folder (stages run at the project's root)."""
    root = tmp_path / "project"
    (root / "texts").mkdir(parents=True)
    monkeypatch.chdir(root)
    return root


def write(path: str, data: str | bytes) -> Path:
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data if isinstance(data, bytes) else data.encode())
    return file


def streams(out: Path, tokenizer) -> dict[str, list[str]]:
    """Each split's documents as the shards hold them: decoded and cut at `<|endoftext|>`."""
    docs = {}
    for split in ("train", "val"):
        ids = np.concatenate([read_shard(p) for p in shard_paths(out, split)]).tolist()
        assert ids[-1] == tokenizer.eot_token  # every document ends with one
        text = tokenizer.decode(ids, errors="strict")
        docs[split] = text.split("<|endoftext|>")[:-1]
    return docs


def test_text_files_are_one_document_each_in_path_order(project: Path, tokenizer) -> None:
    write("texts/b.md", "# Bee\n\nA *markdown* file.\n")
    write("texts/a.txt", "First file.\r\nWindows line endings.\r\n")
    write("texts/sub/c.txt", "\ufeffA byte order mark, dropped.\n")
    write("texts/.hidden.txt", "never read\n")
    write("texts/.git/config", "never read\n")
    write("texts/notes.pdf", b"%PDF-\x00\x01")  # not a corpus file: skipped without a glob
    scan = scan_files(corpus())
    assert [p.as_posix() for p in scan.files] == ["texts/a.txt", "texts/b.md", "texts/sub/c.txt"]
    counts = tokenize_files(scan, project / "out", tokenizer)
    assert streams(project / "out", tokenizer) == {
        "train": ["First file.\nWindows line endings.\n", "# Bee\n\nA *markdown* file.\n"],
        "val": ["A byte order mark, dropped.\n"],  # fewer than val_every documents: the last held out
    }
    assert (
        counts["files"],
        counts["documents"],
        counts["train"]["documents"],
        counts["val"]["documents"],
    ) == (
        3,
        3,
        2,
        1,
    )
    assert counts["tokens"] == counts["train"]["tokens"] + counts["val"]["tokens"]
    report = json.loads((project / "out" / DOCUMENTS_REPORT).read_text())
    assert report["content_sha256"] == counts["content_sha256"] == scan.digest()
    assert [f["file"] for f in report["files"]] == ["texts/a.txt", "texts/b.md", "texts/sub/c.txt"]


def test_jsonl_gzip_and_parquet_rows_are_one_document_each(project: Path, tokenizer) -> None:
    write("texts/1.jsonl", '{"body": "row one", "id": 1}\n\n{"body": "row two"}\n')
    write("texts/2.jsonl.gz", gzip.compress(b'{"body": "zipped row"}\n{"body": null}\n'))
    pd.DataFrame({"body": ["parquet one", "parquet two"], "n": [1, 2]}).to_parquet("texts/3.parquet")
    counts = tokenize_files(scan_files(corpus(text_field="body", val_every=2)), project / "out", tokenizer)
    assert streams(project / "out", tokenizer) == {
        "train": ["row one", "zipped row", "parquet two"],
        "val": ["row two", "parquet one"],  # every 2nd document kept; the null row was dropped as empty
    }
    assert (counts["documents"], counts["dropped_empty"]) == (5, 1)


def test_a_glob_picks_files_and_one_file_is_a_corpus(project: Path) -> None:
    for name in ("a.md", "b.md", "c.txt"):
        write(f"texts/{name}", f"text of {name}\n")
    assert [p.name for p in scan_files(corpus(glob="*.md")).files] == ["a.md", "b.md"]
    write("texts/rows.jsonl", '{"text": "one"}\n{"text": "two"}\n')
    assert scan_files(corpus(path="texts/rows.jsonl")).documents == 2


def test_cleaning_knobs(project: Path, tokenizer) -> None:
    write("texts/1.txt", "a long enough document\r\n")
    write("texts/2.txt", "  \n\n ")
    write("texts/3.txt", "short\r")
    write("texts/4.txt", "another long enough one\n")
    scan = scan_files(corpus(min_chars=10))
    assert (scan.documents, sum(s.dropped_empty for s in scan.summaries)) == (2, 1)
    assert sum(s.dropped_short for s in scan.summaries) == 1
    tokenize_files(scan, project / "out", tokenizer)
    assert streams(project / "out", tokenizer) == {
        "train": ["a long enough document\n"],
        "val": ["another long enough one\n"],
    }
    kept = scan_files(corpus(drop_empty=False, normalize_newlines=False))
    assert kept.documents == 4
    tokenize_files(kept, project / "kept", tokenizer)
    assert streams(project / "kept", tokenizer)["train"] == [
        "a long enough document\r\n",
        "  \n\n ",
        "short\r",
    ]


def test_the_validation_split_is_whole_documents_chosen_by_position(project: Path, tokenizer) -> None:
    for i in range(45):
        write(f"texts/{i:02d}.txt", f"document {i}\n")
    counts = tokenize_files(scan_files(corpus()), project / "out", tokenizer)
    assert streams(project / "out", tokenizer)["val"] == ["document 19\n", "document 39\n"]
    assert (counts["train"]["documents"], counts["val"]["documents"]) == (43, 2)
    again = tokenize_files(scan_files(corpus()), project / "again", tokenizer)
    assert again == counts
    for a, b in zip(sorted((project / "out").iterdir()), sorted((project / "again").iterdir()), strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_another_encoding_is_read_with_the_encoding_knob(project: Path) -> None:
    write("texts/a.txt", "caf\u00e9 au lait\n".encode("latin-1"))
    write("texts/b.txt", "plain\n")
    with pytest.raises(InputError, match=r"texts/a\.txt, line 1: not utf-8 .*corpus\.files\.encoding"):
        scan_files(corpus())
    assert scan_files(corpus(encoding="latin-1")).documents == 2
    with pytest.raises(ConfigError, match="encoding: unknown encoding 'klingon'"):
        corpus(encoding="klingon")


BAD_INPUTS = {
    "not UTF-8": (
        {"texts/ok.txt": "fine\n", "texts/bad.txt": b"line one\nline \xff two\n"},
        {},
        r"^texts/bad\.txt, line 2: not utf-8 \(byte 14\); set corpus\.files\.encoding",
    ),
    "empty corpus": (
        {"texts/readme.pdf": b"%PDF"},
        {},
        r"^corpus\.files\.path 'texts': no \.txt, .* an empty corpus$",
    ),
    "empty after cleaning": (
        {"texts/a.txt": "\n\n", "texts/b.md": "   "},
        {},
        r"^corpus\.files\.path 'texts': 0 document\(s\) left after cleaning \(2 dropped by cleaning",
    ),
    "one document": ({"texts/a.txt": "alone\n"}, {}, r"1 document\(s\) left after cleaning; at least 2"),
    "binary file": (
        {"texts/a.txt": "text\n", "texts/b.txt": b"\x89PNG\r\n\x1a\n\x00\x00"},
        {},
        r"^texts/b\.txt: a binary file, not text \(a NUL byte at line 3\)",
    ),
    "row not JSON": (
        {"texts/a.jsonl": '{"text": "fine"}\n{"text": "unterminated}\n'},
        {},
        r"^texts/a\.jsonl, line 2: not JSON \(Unterminated string starting at, column 10\)$",
    ),
    "row not an object": (
        {"texts/a.jsonl": '["a", "list"]\n'},
        {},
        r"^texts/a\.jsonl, line 1: expected a JSON object with a 'text' field, got list$",
    ),
    "missing text field": (
        {"texts/a.jsonl": '{"text": "fine"}\n{"body": "elsewhere", "id": 2}\n'},
        {},
        r"^texts/a\.jsonl, line 2: no 'text' field \(it has: body, id\); set corpus\.files\.text_field",
    ),
    "text not a string": (
        {"texts/a.jsonl": '{"text": 3}\n'},
        {},
        r"line 1: field 'text' is a int, expected a string",
    ),
    "bad gzip": ({"texts/a.jsonl.gz": b"not gzip"}, {}, r"^texts/a\.jsonl\.gz: not a readable gzip file"),
    "glob takes another kind": ({"texts/a.csv": "a,b\n"}, {"glob": "*"}, r"^texts/a\.csv: not a corpus file"),
    "path not found": ({}, {"path": "nowhere"}, r"^corpus\.files\.path 'nowhere': not found"),
    "path outside the project": (
        {},
        {"path": "../elsewhere"},
        r"^corpus\.files\.path '\.\./elsewhere': outside the project .* DVC cannot track it: copy or move .*dvc add",
    ),
}


@pytest.mark.parametrize("files, changes, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_a_bad_input_is_one_line_naming_its_place(project: Path, files, changes, message) -> None:
    (project.parent / "elsewhere").mkdir()
    (project.parent / "elsewhere" / "a.txt").write_text("outside\n")
    for path, data in files.items():
        write(path, data)
    with pytest.raises(InputError, match=message) as caught:
        scan_files(corpus(**changes))
    assert "\n" not in str(caught.value)


def test_parquet_without_the_text_column_names_its_columns(project: Path) -> None:
    pd.DataFrame({"body": ["x"], "id": [1]}).to_parquet("texts/a.parquet")
    with pytest.raises(InputError, match=r"^texts/a\.parquet: no column 'text' \(it has: body, id\)"):
        scan_files(corpus())
    write("texts/b.parquet", b"PAR1 but not really")
    with pytest.raises(InputError, match=r"^texts/a\.parquet|^texts/b\.parquet: not a readable Parquet file"):
        scan_files(corpus(text_field="body"))


def test_an_absolute_path_outside_the_project_is_refused(project: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.txt").write_text("text\n")
    with pytest.raises(InputError, match="outside the project"):
        scan_files(corpus(path=str(outside)))
    (project / "link").symlink_to(outside)  # a link out of the project is outside too
    with pytest.raises(InputError, match="outside the project"):
        scan_files(corpus(path="link"))
