"""The local `mlflow ui` server behind `gptlab ui`, run as a server should be.

Its URL is printed once the server answers (until then one line says it is starting),
so the first click opens the UI: MLflow's own server takes seconds to tens of seconds
to start on a loaded machine. One that does not answer within the timeout is stopped,
in one line. A busy port is one line naming `--port` (exit 2), found before anything starts: mlflow's
own server prints the URL and a traceback, then exits 0. The server runs in its own
process group (mlflow starts uvicorn and job runners under it); SIGTERM, SIGHUP and Ctrl-C
stop that whole group, so no worker outlives `gptlab ui`. Its start-up INFO lines and the
libraries' deprecation warnings are left out unless `gptlab -v`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gptlab.environment import VERBOSE_ENV
from gptlab.errors import GptlabError, InputError

# Seconds the server's group has to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10
# What the child reads (mlflow's and Python's own variables): deprecation warnings (starlette's
# are UserWarnings whose message starts with its module) and INFO lines off.
QUIET_ENV = {
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore:starlette.",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
}
# Unless the user sets it: no job runner (MLflow's GenAI jobs, which the training runs' UI does not
# use) beside the web server, verbose or not: ~8 Huey consumers, ~15 s of CPU at each start.
NO_JOB_RUNNER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


# Seconds `gptlab ui` waits for its server to answer (--timeout): ~7 s on a quiet machine, ~20 s at load 5.
START_TIMEOUT_S = 120.0
# Seconds between two knocks on a starting server's door.
_POLL_S = 0.25


@dataclass(frozen=True)
class Readiness:
    """When a server counts as up: `probe` (one of its URLs) answers within `timeout_s` of its start.

    `starting` is printed as it starts, `ready` (the URL to open) once it answers.
    """

    probe: str
    starting: str
    ready: str
    timeout_s: float = START_TIMEOUT_S


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on `host:port` (any address: the loopback one)."""
    reachable = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{reachable}]:{port}" if ":" in reachable else f"http://{reachable}:{port}"


class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: stop the server like Ctrl-C does."""


def check_port_free(host: str, port: int) -> None:
    """An InputError naming --port when `host:port` is taken (or cannot be bound)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # As uvicorn binds: a port left in TIME_WAIT by a stopped server counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(
                    f"port {port} on {host} is already in use (another `gptlab ui`?): "
                    "pick another with --port, or stop what is there"
                ) from None
            raise InputError(
                f"cannot listen on {host}:{port} ({exc.strerror}): check --host and --port"
            ) from None


def ui_command(store: str, host: str, port: int) -> list[str]:
    """`mlflow ui` on `store` with one worker (a local UI needs no more; four cost ~3 GiB)."""
    mlflow = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow), "ui", "--backend-store-uri", store, "--registry-store-uri", store]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    if not os.environ.get(VERBOSE_ENV):
        command += ["--uvicorn-opts", "--log-level warning --no-access-log"]
    return command


def serve(
    command: list[str], env: Mapping[str, str] | None = None, readiness: Readiness | None = None
) -> int:
    """Run the server in its own process group until it exits or we are told to stop; its exit code.

    Ctrl-C, SIGTERM and SIGHUP stop the whole group (then 0: the usual way to leave a server).
    With `readiness`, its lines are printed as the server starts and once it answers; a server
    that exits or does not answer in time is a GptlabError (the group stopped).
    """
    child_env = {**NO_JOB_RUNNER, **(os.environ if env is None else env)}
    if not child_env.get(VERBOSE_ENV):
        child_env.update(QUIET_ENV)
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, _raise_stop) for signum in handled}
    server = subprocess.Popen(command, env=child_env, start_new_session=True)
    try:
        if readiness is not None:
            await_answer(server, readiness)
        return server.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_group(server)


def await_answer(server: subprocess.Popen[bytes], readiness: Readiness) -> None:
    """Say the server is starting, wait until it answers, then print where it is."""
    print(readiness.starting, flush=True)
    deadline = time.monotonic() + readiness.timeout_s
    while not _answers(readiness.probe):
        if server.poll() is not None:
            raise GptlabError(
                f"the MLflow UI server exited (code {server.returncode}) before answering at {readiness.probe}; "
                "`gptlab -v ui` shows its log"
            )
        if time.monotonic() >= deadline:
            raise GptlabError(
                f"the MLflow UI did not answer at {readiness.probe} within {readiness.timeout_s:g} s, so it "
                "was stopped: wait longer with --timeout, or see its log with `gptlab -v ui`"
            )
        time.sleep(_POLL_S)
    print(readiness.ready, flush=True)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()  # noqa: S310 - the local server's own URL
    except (OSError, ValueError):
        return False
    return True


def stop_group(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after STOP_TIMEOUT_S."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the group is gone already
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=STOP_TIMEOUT_S)
    # The leader may be gone while its workers linger: the group, not just the leader.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _raise_stop(signum: int, frame: types.FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)
