"""The stage scripts' shared entry point: SIGTERM stops a stage as Ctrl-C does, each in one line."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gptlab.pipeline.params import Params
from gptlab.pipeline.stage import Terminated, sigterm_stops, stage_main
from gptlab.tracking.runs import stage_run
from gptlab.tracking.store import tracking_uri

from helpers import write_committed_params


def sigterm_to_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the handler raises here, at once


def test_sigterm_ends_the_stages_run_killed_and_the_previous_handler_returns() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_stops(), stage_run("eval", "exp-sigterm", {}) as run:
        run_id = run.run_id
        sigterm_to_self()
    assert MlflowClient(tracking_uri()).get_run(run_id).info.status == "KILLED"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stage_stopped_by_sigterm_says_so_in_one_line_and_exits_143(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params_file = write_committed_params(tmp_path)

    def run(params: Params) -> None:
        sigterm_to_self()

    with pytest.raises(SystemExit) as exit_info:
        stage_main(run, "a stage", ["--params", str(params_file)])
    assert exit_info.value.code == 128 + signal.SIGTERM
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("stopped by SIGTERM: rerun the stage")


def test_the_sigterm_line_starts_a_line_of_its_own_after_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bar mid-way holds stderr's line without a newline: the stop line must not be glued to it."""
    from tqdm import tqdm

    params_file = write_committed_params(tmp_path)

    def run(params: Params) -> None:
        bar = tqdm(total=10, desc="training", file=sys.stderr)
        bar.update(3)
        bar.refresh()
        sigterm_to_self()

    with pytest.raises(SystemExit):
        stage_main(run, "a stage", ["--params", str(params_file)])
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any(line.startswith("training:") for line in lines)
    assert [line for line in lines if "stopped by SIGTERM" in line][0].startswith("stopped by SIGTERM: rerun")


def test_a_stage_stopped_by_ctrl_c_says_so_in_one_line_and_exits_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params_file = write_committed_params(tmp_path)

    def run(params: Params) -> None:
        with stage_run("eval", "exp-sigint", {}) as tracked:
            runs.append(tracked.run_id)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # Python's handler raises KeyboardInterrupt here, at once

    runs: list[str] = []
    # Python's own SIGINT handler, as in a terminal (a shell's background job starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exit_info:
            stage_main(run, "a stage", ["--params", str(params_file)])
    finally:
        signal.signal(signal.SIGINT, before)
    assert exit_info.value.code == 128 + signal.SIGINT
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("stopped by SIGINT (Ctrl-C): rerun the stage")
    assert MlflowClient(tracking_uri()).get_run(runs[0]).info.status == "KILLED"
