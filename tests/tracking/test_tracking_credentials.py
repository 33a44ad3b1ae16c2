"""Tracking URIs with credentials (issue 43, items 4 and 5): accepted as MLflow accepts them, never printed.

A real `mlflow server` takes any credentials; what is checked is that gptlab's reachability probe
reaches it through `user:password@`, and that no stage, `gptlab ui` or `classify` output shows the password.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gptlab.cli.main import main
from gptlab.tracking.runs import stage_run
from gptlab.tracking.store import TrackingLost, check_reachable, masked_uri

from helpers import (
    PROJECT_ROOT,
    MlflowServer,
    closed_url,
    committed_params,
    one_line_error,
    write_committed_params,
)

PASSWORD = "S3cr3tPW"


def test_masked_uri_hides_the_password_of_every_uri_in_a_text() -> None:
    assert masked_uri(f"http://alice:{PASSWORD}@host:5000") == "http://alice:***@host:5000"
    assert masked_uri("https://alice:p@ss@host/mlflow") == "https://alice:***@host/mlflow"
    assert masked_uri(f"postgresql://u:{PASSWORD}@db/mlflow") == "postgresql://u:***@db/mlflow"
    said = f"API request to http://a:{PASSWORD}@h:1/api failed; retried http://b:{PASSWORD}@h:2"
    assert masked_uri(said) == "API request to http://a:***@h:1/api failed; retried http://b:***@h:2"
    for unchanged in ("http://host:5000", "http://alice@host", "sqlite:////tmp/a@b/mlflow.db", "databricks"):
        assert masked_uri(unchanged) == unchanged


@contextmanager
def mlflow_like_server() -> Iterator[tuple[str, list[str | None]]]:
    """A server answering MLflow's search of experiments, in a thread: its URL and each Authorization it got."""
    sent: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            sent.append(self.headers.get("Authorization"))
            body = json.dumps({"experiments": []}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", sent
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    ("userinfo", "env", "authorization"),
    [
        ("alice:S3cr3tPW@", {}, basic("alice", PASSWORD)),
        (
            "",
            {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": PASSWORD},
            basic("bob", PASSWORD),
        ),
        (
            "alice:S3cr3tPW@",
            {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "x"},
            basic("alice", PASSWORD),
        ),
        ("", {"MLFLOW_TRACKING_TOKEN": PASSWORD}, f"Bearer {PASSWORD}"),
        ("", {}, None),
    ],
    ids=["uri", "username-password", "uri-over-environment", "token", "none"],
)
def test_the_reachability_check_sends_the_credentials_mlflows_own_calls_send(
    userinfo: str, env: dict[str, str], authorization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a server that asks for a login gets first: the login MLflow's client sends, the URI's winning."""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with mlflow_like_server() as (host, sent):
        check_reachable(f"http://{userinfo}{host}")
    assert sent == [authorization]


def test_an_unreachable_server_is_named_without_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    host = closed_url().removeprefix("http://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{PASSWORD}@{host}")
    monkeypatch.setenv("GPTLAB_TRACKING_TIMEOUT", "2")
    assert main(["ui", "--experiment", "exp", "--print-url"]) == 2
    line = one_line_error(capsys, "ui")
    assert f"http://alice:***@{host} is unreachable" in line and "Connection refused" in line, line


@pytest.mark.slow
def test_credentials_in_the_uri_or_the_environment_reach_the_server_and_are_never_shown(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    write_committed_params(tmp_path)
    experiment_name = committed_params().tracking.experiment
    host = server.uri.removeprefix("http://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{PASSWORD}@{host}")
    report = ["report", "--reports", str(tmp_path / "reports"), "--out", str(tmp_path / "R.md"), "--log"]
    report += ["--book", str(PROJECT_ROOT / "reproduction" / "book.yaml")]
    assert main(report) == 0  # a stage's run: checked, logged and ended through the credentials
    out, err = capsys.readouterr()
    assert f"View run at: http://alice:***@{host}/#/experiments/" in out

    assert main(["ui", "--print-url"]) == 0
    ui_out, ui_err = capsys.readouterr()
    assert f"http://alice:***@{host}/#/experiments/" in ui_out

    assert main(["classify", "--model", "models:/gptlab-spam@champion", "hi"]) == 2
    line = one_line_error(capsys, "classify")
    assert f"no such model in http://alice:***@{host}" in line, line
    assert PASSWORD not in out + err + ui_out + ui_err + line

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    assert main(report) == 0
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", PASSWORD)
    assert main(report) == 0
    assert PASSWORD not in "".join(capsys.readouterr())

    client = MlflowClient(tracking_uri=server.uri)
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`gptlab.stage` = 'report'")
    assert [run.info.status for run in runs] == ["FINISHED"] * 3


@pytest.mark.slow
def test_mlflows_own_warning_about_a_lost_server_shows_no_password(
    server: MlflowServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow's system metrics monitor warns, quoting the URL it called, when the server stops
    answering mid-run: the password in that URL is masked like every line gptlab prints."""
    host = server.uri.removeprefix("http://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{PASSWORD}@{host}")
    # The monitor reads its run after each sample: every 0.2 s here.
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with pytest.raises(TrackingLost), stage_run("report", "exp-monitor", {"toy": 1}, system_metrics=True):
        (monitor,) = [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor"]
        server.kill()
        monitor.join(timeout=60)  # it warns once and stops when its run cannot be read
        assert not monitor.is_alive()
    err = capsys.readouterr().err
    assert (
        f"Failed to get mlflow run: API request to http://alice:***@{host}/api/2.0/mlflow/runs/get" in err
    ), err
    assert PASSWORD not in err
