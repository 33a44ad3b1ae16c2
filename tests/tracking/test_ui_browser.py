"""The MLflow UI in a real browser (Debian's headless Chromium) on a store that real stage runs made:
one row per pipeline run in model-training mode, its headline metrics first, its stages nested under
it; charts by stage; two pipeline runs compared in one selection and one click.

Two DVC experiments (pretrain and eval, on a tiny GPT) fill the store; `gptlab ui` serves it.
Set GPTLAB_UI_SCREENSHOTS to a folder to keep screenshots of the runs table and the compare view.
"""

from __future__ import annotations

import os
import re
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

from helpers import committed_params_raw, copy_code, copy_empty_store, dvc, git

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
def served(
    tmp_path_factory: pytest.TempPathFactory, shared_data: Path, empty_store: Path
) -> Iterator[tuple[str, str, str]]:
    """(UI URL that `gptlab ui` prints, MLflow store URI, experiment id) after two DVC experiments."""
    project = tmp_path_factory.mktemp("ui") / "project"
    tiny_project(project)
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    copy_empty_store(empty_store, db)
    store = f"sqlite:///{db}"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": store,
        "PYTHONPATH": str(project / "src"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "OMP_NUM_THREADS": "1",
    }
    dvc(project, "exp", "run", "--name", "lr-a", "eval", env=env, timeout=900)
    dvc(
        project,
        "exp",
        "run",
        "--name",
        "lr-b",
        "-S",
        "pretrain.train.lr=0.001",
        "eval",
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
        assert server.stdout.readline().startswith("starting the MLflow UI")
        url = server.stdout.readline().split(": ", 1)[1].strip()  # printed once the server answers
        experiment_id = url.split("/experiments/")[1].split("/")[0]
        assert _answers(f"http://127.0.0.1:{port}/health")
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


def header_x(driver, name: str) -> int:
    """Where the runs table's column `name` starts, left to right."""
    return driver.find_element(
        "xpath", f"//*[@role='columnheader']//*[normalize-space(text())='{name}']"
    ).location["x"]


def chart_sections(text: str) -> set[str]:
    """The chart view's sections, each heading a line followed by its chart count `(4)`."""
    lines = text.splitlines()
    return {lines[i - 1] for i in range(1, len(lines)) if re.fullmatch(r"\(\d+\)", lines[i])}


def click_text(driver, text: str, tag: str = "button") -> None:
    driver.find_element("xpath", f"//{tag}[normalize-space(.)='{text}']").click()


def test_one_row_per_pipeline_run_then_compare_and_charts_by_stage(served, browser) -> None:
    """One user's walk through the UI: one test, so that one worker fills the store (a minute) once."""
    walk_through_the_ui(browser, *served)


def walk_through_the_ui(browser, url: str, store: str, experiment_id: str) -> None:
    client = mlflow.MlflowClient(tracking_uri=store)
    runs = client.search_runs([experiment_id])
    parents = {run.info.run_name: run for run in runs if run.data.tags.get("gptlab.role") == "pipeline"}
    assert set(parents) == {"pipeline · lr-a", "pipeline · lr-b"}
    stages = [run for run in runs if "gptlab.stage" in run.data.tags]
    assert {run.data.tags["mlflow.parentRunId"] for run in stages} == {
        p.info.run_id for p in parents.values()
    }
    # Each pipeline run holds the whole params.yaml it ran with: like with like, lr-b differs in its lr alone.
    lr_a, lr_b = parents["pipeline · lr-a"].data.params, parents["pipeline · lr-b"].data.params
    assert set(lr_a) == set(lr_b) and len(lr_a) > 100
    assert {key for key, value in lr_a.items() if lr_b[key] != value} == {"pretrain.train.lr"}
    assert (
        lr_b["pretrain.train.lr"] == "0.001"
        and parents["pipeline · lr-b"].data.tags["gptlab.dvc_exp"] == "lr-b"
    )
    # DVC's -S values are no uncommitted code.
    assert {run.data.tags["gptlab.git_dirty"] for run in runs} == {"false"}
    # No chart can mix stages: each stage's run logs under its own prefix only.
    for run in stages:
        prefix = run.data.tags["gptlab.stage"].removesuffix("-finetune") + "/"
        assert all(name.startswith((prefix, "system/")) for name in run.data.metrics), run.data.metrics

    # The default view: one row per pipeline run (its stages collapsed under it), headline metrics first.
    text = show(browser, url, "pipeline · lr-a", "pipeline · lr-b", "pretrain/final_val_loss")
    screenshot(browser, "runs_table")
    # Model training's navigation (GenAI's would offer Overview, Evaluation, Prompts ...).
    assert "Runs" in text and "Model registry" in text and "Evaluation" not in text
    assert "pretrain · lr-a" not in text and "0.001" in text and "0.005" in text  # each run's lr in its row
    assert header_x(browser, "pretrain/final_val_loss") < header_x(browser, "pretrain.train.lr")
    assert header_x(browser, "pretrain.train.lr") < header_x(browser, "Duration")
    headers = {cell.text for cell in browser.find_elements("xpath", "//*[@role='columnheader']")}
    assert not {"Dataset", "Source", "Models"} & headers, headers

    # The chart view draws every run the table shows (MLflow's default: the first 10), in one section
    # of charts per stage: a chart is one metric, and each metric is one stage's.
    text = show(browser, f"{url}&compareRunsMode=CHART", "pipeline · lr-a", "eval/val_loss")
    screenshot(browser, "charts")
    assert chart_sections(text) >= {"eval", "pretrain"}
    # Each pipeline run's "+" expands it: its stages' runs are drawn too, their curves in their stage's section.
    for expander in browser.find_elements(
        "xpath", "//*[contains(@data-component-id, 'runnamecellrenderer')]"
    ):
        expander.click()
    wait_until(lambda: "pretrain/curves" in chart_sections(page_text(browser)), "no pretrain curve was drawn")
    text = page_text(browser)
    assert "pretrain · lr-a" in text and "eval · lr-b" in text
    sections = chart_sections(text) - {"Model metrics", "System metrics"}
    assert all(section.split("/")[0] in ("pretrain", "eval") for section in sections), sections

    # Compare: one selection (the table's select-all box: the two pipeline runs), one click.
    show(browser, url, "pipeline · lr-a", "pipeline · lr-b")
    (select_all,) = [
        box for box in browser.find_elements("css selector", ".ag-header-select-all") if box.is_displayed()
    ]
    select_all.click()
    click_text(browser, "Compare")
    text = show(browser, browser.current_url, "Comparing 2 Runs", "pipeline · lr-a", "pipeline · lr-b")
    wait_until(lambda: "pretrain_loss.png" in page_text(browser), "the compare view showed no loss figure")
    screenshot(browser, "compare_view")
    text = page_text(browser)
    plotted = text.split("Metrics:", 1)[1].split("\n", 2)[1]  # the parallel-coordinates plot's metric
    assert plotted.split("/")[0] in ("pretrain", "eval"), plotted
    # The plot's default axes are the params that differ, the table marks the rows that differ: the lr alone.
    axes = text.split("Parameters:", 1)[1].split("Metrics:", 1)[0].split()
    assert axes == ["pretrain.train.lr"], axes
    (params_table,) = [
        table
        for table in browser.find_elements("css selector", "table.mlflow-compare-run-table")
        if "pretrain.train.lr" in table.get_attribute("textContent")
    ]
    differing = params_table.find_elements("css selector", "tr.diff-row th")
    assert [row.get_attribute("textContent").strip() for row in differing] == ["pretrain.train.lr"]
