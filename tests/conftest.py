"""Shared fixtures: the pipeline's inputs, the tokenizer, a tiny checkpoint, and a throwaway MLflow store per test."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import (
    PROJECT_ROOT,
    TINY_GPT,
    MlflowServer,
    committed_params,
    gutenberg_inputs,
    inputs_dir,
    isolated_environment,
)

# A few real Gutenberg books for the corpus tests (~1.1 MB): three with Project Gutenberg's
# START/END markers, and one without.
TEST_BOOKS = (
    "alcott-louisa-may--a-garland-for-girls.txt",
    "alcott-louisa-may--a-modern-cinderella-or-the-little-old-shoe-and-other-stories.txt",
    "alger-horatio-jr--a-boys-fortune-or-the-strange-adventures-of-ben-baker.txt",
    "shakespeare-william--antony-and-cleopatra.txt",
)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`-n auto`), each worker gets its share of the cores, set before torch loads.

    Without it, N workers of N threads each would fight over the cores. Subprocesses inherit it.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding end-to-end (slow) tests first, each kept whole for its module fixtures.

    Under `-n auto` the long runs then start at once, and the short tests fill the end.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


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


@pytest.fixture(scope="session")
def gutenberg_books() -> list:
    """TEST_BOOKS, in the committed list's order, fetched into the tests' cache (see gutenberg_inputs)."""
    from gptlab.data.gutenberg import read_book_list

    books = [
        b
        for b in read_book_list(PROJECT_ROOT / committed_params().corpus.gutenberg.books)
        if b.file in TEST_BOOKS
    ]
    gutenberg_inputs(books)
    return books


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A tiny pretrain checkpoint (TINY_GPT, seed 0) saved in tmp_path/models/pretrain."""
    # torch: imported only by the tests that ask for a checkpoint, not by every test's start
    import torch

    from gptlab.model.build import build_gpt
    from gptlab.model.checkpoint import save_model

    torch.manual_seed(0)
    return save_model(build_gpt(TINY_GPT).eval(), tmp_path / "models" / "pretrain", {"stage": "pretrain"})


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new MLflow SQLite store, created by MLflow once per session: its ~30 schema migrations take
    seconds, which each test's store would otherwise pay again (a copy takes milliseconds)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-empty") / "mlflow.db"
    # Quietly: SQLAlchemy's deprecations and MLflow's INFO lines inside its migrations are not the tests'.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        logging.disable(logging.INFO)
        try:
            MlflowClient(f"sqlite:///{db}").search_experiments()
        finally:
            logging.disable(logging.NOTSET)
    return db


@pytest.fixture(autouse=True)
def isolated_tools(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, empty_store: Path
) -> Iterator[str]:
    """Every test gets its own real MLflow store; nothing phones home or writes outside tmp."""
    environment = isolated_environment(tmp_path_factory, empty_store)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    uri = environment["MLFLOW_TRACKING_URI"]
    yield uri
    # A stage run in-process sets MLflow's global URI, which outranks the next test's variable.
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real `mlflow server` per test module: each start costs seconds. Tests that kill it
    leave it to `server` to start again; runs stay apart by their names."""
    running = MlflowServer(tmp_path_factory.mktemp("server"))
    try:
        yield running
    finally:
        running.kill()


@pytest.fixture
def server(module_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> MlflowServer:
    """A real `mlflow server` in a subprocess, running, MLFLOW_TRACKING_URI pointing at it, a 3 s
    tracking timeout."""
    if not module_server.running:
        module_server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", module_server.uri)
    monkeypatch.setenv("GPTLAB_TRACKING_TIMEOUT", "3")
    return module_server
