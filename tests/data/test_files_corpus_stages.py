"""corpus.name files through the stages: tokenize refuses bad files whole; DVC reruns what an edit touches; pretrain and eval train on it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
import yaml

from helpers import PROJECT_ROOT, commit_as_fresh_clone, committed_params_raw, copy_project, dvc, project_env

EXAMPLE_TEXTS = "examples/own-data/texts"


def test_tokenize_refuses_a_bad_file_in_one_line_writing_nothing(
    shared_data: Path, tmp_path: Path, isolated_tools: str
) -> None:
    raw = committed_params_raw()
    raw["data"] |= {"raw_dir": str(shared_data), "processed_dir": "data/processed"}
    raw["corpus"]["name"] = "files"
    raw["corpus"]["files"]["path"] = "texts"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("a good document\n")
    (tmp_path / "texts" / "b.jsonl").write_text('{"text": "one"}\n{"txt": "two"}\n')
    proc = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "stages" / "tokenize_data.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: texts/b.jsonl, line 2: no 'text' field (it has: txt); set corpus.files.text_field to the text's field"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "texts"]  # no data/, no reports/
    with closing(sqlite3.connect(isolated_tools.removeprefix("sqlite:///"))) as db:
        assert db.execute("SELECT count(*) FROM runs").fetchone() == (0,)  # no MLflow run started for it


@pytest.mark.slow
def test_dvc_reruns_tokenize_after_one_file_is_edited_and_pretrain_trains_on_it(
    tmp_path: Path, shared_data: Path, isolated_tools: str
) -> None:
    project = tmp_path / "project"
    copy_project(project)
    raw = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    smoke = yaml.safe_load((PROJECT_ROOT / "profiles" / "gutenberg-smoke.yaml").read_text(encoding="utf-8"))
    raw["corpus"]["name"] = "files"
    raw["corpus"]["files"] |= {"path": EXAMPLE_TEXTS, "val_every": 2}  # 5 texts: 3 to train on, 2 held out
    for key in ("spam", "instruct", "preference"):
        raw["tokenize"][key] |= smoke["tokenize"][key]
    for key in ("model", "data", "train"):
        raw["pretrain"][key] |= smoke["pretrain"][key]
    raw["pretrain"]["data"]["max_length"] = raw["pretrain"]["data"]["stride"] = 64  # the texts are short
    raw["pretrain"]["train"] |= {"global_batch_tokens": None, "max_tokens": 2048}
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    commit_as_fresh_clone(project)
    env = project_env(project)
    dvc(project, "repro", "tokenize", env=env)
    counts = json.loads((project / "reports/tokenize/counts.json").read_text())["files"]
    assert (counts["files"], counts["train"]["documents"], counts["val"]["documents"]) == (5, 3, 2)

    edited = sorted((project / EXAMPLE_TEXTS).iterdir())[0]
    edited.write_text(edited.read_text() + "\nOne more line.\n")
    status = json.loads(dvc(project, "status", "--json", "download", "tokenize", env=env).stdout)
    assert set(status) == {"tokenize"}
    assert {"changed deps": {EXAMPLE_TEXTS: "modified"}} in status["tokenize"]
    second = dvc(project, "repro", "eval", env=env, timeout=600)
    assert "'download' didn't change" in second.stdout
    assert "Running stage 'tokenize'" in second.stdout and "Running stage 'eval'" in second.stdout
    again = json.loads((project / "reports/tokenize/counts.json").read_text())["files"]
    assert again["tokens"] > counts["tokens"] and again["content_sha256"] != counts["content_sha256"]
    losses = (project / "reports/pretrain/losses.csv").read_text().splitlines()
    assert losses[0].endswith("val_perplexity")  # a corpus run's columns, as for the books
    assert (project / "reports/eval/metrics.json").is_file()
