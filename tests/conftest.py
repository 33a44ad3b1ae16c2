"""Shared fixtures: the data mirror, the tokenizer, and a throwaway MLflow store per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT


def mirror_dir() -> Path:
    """The byte-identical mirror of the pipeline's inputs (GPTLAB_MIRROR, else ../shared/data)."""
    return Path(os.environ.get("GPTLAB_MIRROR") or PROJECT_ROOT.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = mirror_dir()
    assert (path / "the-verdict.txt").is_file(), f"data mirror not found at {path}; set GPTLAB_MIRROR"
    return path


@pytest.fixture(scope="session")
def tokenizer(shared_data: Path):
    from gptlab.tokenizer import load_tokenizer

    return load_tokenizer(shared_data)


@pytest.fixture(autouse=True)
def isolated_tools(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test gets its own real MLflow store; nothing phones home or writes outside tmp."""
    store = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{store}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path_factory.mktemp("dvc-site")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GPTLAB_MIRROR", str(mirror_dir()))
    return uri
