"""The MLflow UI in a real browser (Debian's headless Chromium) on a store that real stage runs made:
the runs open in model-training mode, named by stage and experiment, with the key columns and the figures.

Two DVC experiments of the pretrain stage on a tiny GPT fill the store; `gptlab ui` serves it.
Set GPTLAB_UI_SCREENSHOTS to a folder to keep screenshots of the runs table and the compare view.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import pytest
import yaml

from helpers import committed_params_raw, copy_code, dvc, git

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# A developer's machine may lack a browser; CI installs Debian's (.ci/run), so CI always runs this.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="needs Chromium and its driver (apt-get install chromium chromium-driver)",
    ),
]
# Generous: two cores shared with other work can take a minute to start the UI's workers.
WAIT_S = 240


def tiny_project(project: Path) -> None:
    """The pipeline's code with params shrunk to a pretrain run of seconds (1 epoch of a 1-layer GPT)."""
    copy_code(project)
    params = committed_params_raw()
    pretrain = params["pretrain"]
    pretrain["model"].update(context_length=32, emb_dim=32, n_layers=1, n_heads=2)
    pretrain["data"].update(max_length=32, stride=64)
    pretrain["train"].update(batch_size=8, epochs=1, lr=0.005, eval_freq=4, eval_iter=2, device="cpu")
    pretrain["sample"]["max_new_tokens"] = 4
    params["checkpoints"]["every_steps"] = 100
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git(project, "init", "-q")
    dvc(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "tiny")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Iterator[tuple[str, str, str]]:
    """(UI URL that `gptlab ui` prints, MLflow store URI, experiment id) after two pretrain experiments."""
    project = tmp_path_factory.mktemp("ui") / "project"
    tiny_project(project)
    store = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": store,
        "PYTHONPATH": str(project / "src"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "OMP_NUM_THREADS": "1",
    }
    dvc(project, "exp", "run", "--name", "lr-a", "pretrain", env=env, timeout=900)
    dvc(
        project,
        "exp",
        "run",
        "--name",
        "lr-b",
        "-S",
        "pretrain.train.lr=0.001",
        "pretrain",
        env=env,
        timeout=900,
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("gptlab")), "ui", "--port", str(port)],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # the server's workers too, to stop them all
    )
    try:
        url = server.stdout.readline().split(": ", 1)[1].strip()
        experiment_id = url.split("/experiments/")[1].split("/")[0]
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"), "the MLflow UI did not come up")
        yield url, store, experiment_id
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except OSError:
        return False
    return True


def wait_until(condition: Callable[[], object], message: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(1)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory() as profile:  # a browser new to MLflow: no mode remembered
        for flag in (
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=2400,1000",
        ):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(WAIT_S)
        try:
            yield driver
        finally:
            driver.quit()


def page_text(driver) -> str:
    return driver.find_element("tag name", "body").text


def show(driver, url: str, *expected: str) -> str:
    """Open `url` and wait until the page shows every `expected` text; the page's text."""
    driver.get(url)
    wait_until(lambda: all(text in page_text(driver) for text in expected), f"{url} never showed {expected}")
    return page_text(driver)


def screenshot(driver, name: str) -> None:
    folder = os.environ.get("GPTLAB_UI_SCREENSHOTS")
    if folder:
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def test_the_runs_table_opens_in_model_training_then_the_compare_view_and_a_runs_figure(
    served, browser
) -> None:
    """One user's walk through the UI: one test, so that one worker fills the store (a minute) once."""
    url, store, experiment_id = served
    text = show(browser, url, "pretrain · lr-a", "pretrain · lr-b", "final/val_loss")
    screenshot(browser, "runs_table")
    # Model training's navigation (GenAI's would offer Overview, Evaluation, Prompts ...).
    assert "Runs" in text and "Model registry" in text and "Evaluation" not in text
    # The view's columns that these runs have values for (the UI hides a metric no run logged).
    for column in ("pretrain.train.lr", "final/val_loss"):
        assert column in text, column
    assert "0.001" in text and "0.005" in text  # each run's lr in its own row

    # The compare view names each run; a run's artifacts show its figure.
    client = mlflow.MlflowClient(tracking_uri=store)
    runs = client.search_runs([experiment_id], filter_string="tags.`gptlab.stage` = 'pretrain'")
    assert sorted(run.info.run_name for run in runs) == ["pretrain · lr-a", "pretrain · lr-b"]
    assert len({run.data.tags["gptlab.pipeline_run"] for run in runs}) == 2
    base = url.split("#/")[0]
    ids = json.dumps([run.info.run_id for run in runs]).replace(" ", "")
    compare = f"{base}#/compare-runs?runs={ids}&experiments={json.dumps([experiment_id])}&workflowType=machine_learning"
    show(browser, compare, "pretrain · lr-a", "pretrain · lr-b", "pretrain.train.lr")
    screenshot(browser, "compare_view")

    run = runs[0]
    artifacts = (
        f"{base}#/experiments/{experiment_id}/runs/{run.info.run_id}/artifacts?workflowType=machine_learning"
    )
    text = show(browser, artifacts, "pretrain")
    browser.find_element("xpath", "//*[normalize-space(text())='pretrain']").click()
    wait_until(lambda: "loss.png" in page_text(browser), "the run's artifacts never showed pretrain/loss.png")
    assert "samples.txt" in page_text(browser), text
