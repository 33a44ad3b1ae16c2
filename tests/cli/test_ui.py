"""`gptlab ui`: the MLflow UI on the project's store, at the experiment's training runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from gptlab.cli.main import main
from gptlab.cli.ui_server import Readiness, serve
from gptlab.environment import VERBOSE_ENV
from gptlab.errors import GptlabError
from gptlab.tracking.runs import stage_run


def test_the_url_opens_the_experiments_runs_in_the_model_training_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["ui", "--experiment", "exp-ui", "--print-url"]) == 0
    assert "no experiment 'exp-ui' yet" in capsys.readouterr().out
    with stage_run("pretrain", "exp-ui", {}) as run:
        experiment_id = run.client.get_run(run.run_id).info.experiment_id
    assert main(["ui", "--experiment", "exp-ui", "--print-url", "--port", "5123"]) == 0
    url = (
        f"http://127.0.0.1:5123/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        "&viewStateShareKey=gptlab"  # the runs table's columns, stored in the experiment by its first run
    )
    assert capsys.readouterr().out.strip().endswith(url)
    tags = run.client.get_experiment(experiment_id).tags
    assert (
        "metrics.`pretrain/final_val_loss`"
        in json.loads(tags["mlflow.sharedViewState.gptlab"])["selectedColumns"]
    )


def test_a_busy_port_is_one_line_naming_port_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["ui", "--experiment", "exp-ui", "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no URL of a server that never started
    assert err.count("\n") == 1 and f"port {port}" in err and "--port" in err, err


@pytest.mark.parametrize(("verbose", "chosen"), [("", None), ("1", None), ("", "true")])
def test_the_server_starts_no_job_runner_unless_the_user_asks_verbose_or_not(
    verbose: str, chosen: str | None, capfd: pytest.CaptureFixture[str]
) -> None:
    env = {**os.environ, VERBOSE_ENV: verbose}
    env.pop("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", None)
    if chosen is not None:
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = chosen
    reads = "import os; print(os.environ['MLFLOW_SERVER_ENABLE_JOB_EXECUTION'])"
    assert serve([sys.executable, "-c", reads], env) == 0
    assert capfd.readouterr().out.strip() == (chosen or "false")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A server that starts listening after a second, answers one request, and exits.
ANSWERS_ONCE = """
import http.server, sys, time
time.sleep(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"OK")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).handle_request()
"""


def test_the_url_is_printed_once_the_server_answers_after_a_line_saying_it_starts(
    capfd: pytest.CaptureFixture[str],
) -> None:
    port = free_port()
    readiness = Readiness(f"http://127.0.0.1:{port}/health", "starting ...", "MLflow UI: <url>", timeout_s=60)
    assert serve([sys.executable, "-c", ANSWERS_ONCE, str(port)], readiness=readiness) == 0
    # It served one request, the readiness probe's: the URL came after the server had answered.
    assert capfd.readouterr().out == "starting ...\nMLflow UI: <url>\n"


@pytest.mark.parametrize(
    ("server", "said"),
    [
        ("import time; time.sleep(60)", "did not answer at {probe} within 1 s, so it was stopped"),
        ("import sys; sys.exit(3)", "exited (code 3) before answering at {probe}"),
    ],
)
def test_a_server_that_does_not_come_up_is_one_line_and_leaves_nothing_running(
    server: str, said: str, capfd: pytest.CaptureFixture[str]
) -> None:
    probe = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(GptlabError) as failed:
        serve(
            [sys.executable, "-c", server], readiness=Readiness(probe, "starting ...", "never", timeout_s=1)
        )
    assert str(failed.value) == str(failed.value).strip() and "\n" not in str(failed.value)
    assert said.format(probe=probe) in str(failed.value)
    assert time.monotonic() - started < 30 and not descendants(os.getpid())
    assert capfd.readouterr().out == "starting ...\n"  # no URL of a server that is not there


def test_a_timeout_of_no_seconds_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["ui", "--timeout", "0"])
    assert refused.value.code == 2 and "--timeout" in capsys.readouterr().err


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_it_serves_the_projects_store_quietly_and_a_signal_stops_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: signal.Signals
) -> None:
    monkeypatch.chdir(tmp_path)
    with stage_run("pretrain", "exp-ui", {}) as run:
        experiment_id = run.client.get_run(run.run_id).info.experiment_id
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gptlab = str(Path(sys.executable).with_name("gptlab"))
    server = subprocess.Popen(
        [gptlab, "ui", "--experiment", "exp-ui", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT as in a terminal: a shell's background job (this test's, maybe) starts with it ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - no threads started
    )
    workers: list[psutil.Process] = []
    try:
        # One line while it starts; the URL once the server answers, so the first request gets the UI.
        # No address on the first line: a click on it would find nothing for seconds.
        starting = server.stdout.readline()
        assert starting.startswith(f"starting the MLflow UI on port {port} ") and "http" not in starting
        ready = server.stdout.readline()
        assert ready.startswith("MLflow UI ready, ") and f"/#/experiments/{experiment_id}/runs" in ready
        api = f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get?experiment_id={experiment_id}"
        with urllib.request.urlopen(api, timeout=30) as answer:
            experiment = json.load(answer)["experiment"]
        assert experiment["name"] == "exp-ui"
        tags = {tag["key"]: tag["value"] for tag in experiment["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        workers = descendants(server.pid)
        assert workers, "the server runs in child processes"
        assert not [w for w in workers if "huey" in " ".join(w.cmdline())], "no job runner beside the UI"
        server.send_signal(stop)  # to gptlab alone, as `kill PID` or Ctrl-C in its terminal would
        assert server.wait(timeout=60) == 0
        _, err = server.communicate(timeout=10)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == [], f"left running: {[p.pid for p in alive]}"
        assert "Warning" not in err and " INFO " not in err, err
    finally:  # whatever a failed assertion left running
        if server.poll() is None:
            server.kill()
        for process in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
