"""Shared fixtures: the pipeline's inputs, the tokenizer, a tiny checkpoint, and a throwaway MLflow store per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import TINY_GPT, MlflowServer, cache_dir, inputs_dir


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """A folder holding every input params.yaml pins, each at its `path` (laid out like a mirror).

    Fetched on first use into the per-user cache (GPTLAB_CACHE_DIR): from GPTLAB_MIRROR if set,
    else from the pinned URLs, sha256-verified. Only tests that request it need network or a mirror.
    """
    return inputs_dir()


@pytest.fixture(scope="session")
def tokenizer(shared_data: Path):
    from gptlab.model.tokenizer import load_tokenizer

    return load_tokenizer(shared_data)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A tiny pretrain checkpoint (TINY_GPT, seed 0) saved in tmp_path/models/pretrain."""
    # torch: imported only by the tests that ask for a checkpoint, not by every test's start
    import torch

    from gptlab.model.checkpoint import save_model
    from gptlab.model.fast_kernels import build_gpt

    torch.manual_seed(0)
    return save_model(build_gpt(TINY_GPT).eval(), tmp_path / "models" / "pretrain", {"stage": "pretrain"})


@pytest.fixture(autouse=True)
def isolated_tools(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Every test gets its own real MLflow store; nothing phones home or writes outside tmp."""
    store = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{store}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path_factory.mktemp("dvc-site")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The stages a test runs find their inputs in the tests' cache (filled by `shared_data`).
    monkeypatch.setenv("GPTLAB_MIRROR", str(cache_dir()))
    yield uri
    # A stage run in-process sets MLflow's global URI, which outranks the next test's variable.
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MlflowServer]:
    """A real `mlflow server` in a subprocess, MLFLOW_TRACKING_URI pointing at it, a 3 s tracking timeout."""
    running = MlflowServer(tmp_path / "server")
    running.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", running.uri)
    monkeypatch.setenv("GPTLAB_TRACKING_TIMEOUT", "3")
    try:
        yield running
    finally:
        running.kill()
